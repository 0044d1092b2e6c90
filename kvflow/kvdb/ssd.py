"""SsdTier: records (header + payload, see ``codec``) in a StorageEngine, with accounting.

The tier accounts each record's footprint in the engine's files (``StorageEngine.footprint``:
LMDB's overflow pages round a record up to whole pages), so ``capacity`` bounds the disk used.

Thread-safety: ``read_into`` may run concurrently with anything; the mutating methods and the
``sizes`` map are serialised by the shard's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.kvdb import codec
from kvflow.kvdb.engines import StorageEngine
from kvflow.kvdb.errors import ChecksumError
from kvflow.kvdb.keys import KEY_BYTES, BlockKey

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdoptedRecord:
    """A valid record found on disk at open."""

    key: BlockKey
    header: codec.RecordHeader
    size: int


class SsdTier:
    """The SSD tier of one shard: ``capacity`` bytes of records in ``engine``."""

    def __init__(
        self, engine: StorageEngine, capacity: int, *, compress: bool, level: int, shuffle: int
    ) -> None:
        self.engine = engine
        self.capacity = capacity
        self.compress = compress
        self.level = level
        self.shuffle = shuffle
        self.sizes: dict[BlockKey, int] = {}
        self.used = 0

    def encode(
        self, raw: np.ndarray, raw_checksum: int, parent: BlockKey | None, tenant: str
    ) -> bytes:
        """A record for ``raw``, owned by ``tenant`` (CPU-bound; safe from any thread)."""
        return codec.encode_record(
            raw,
            raw_checksum,
            parent,
            tenant=tenant,
            compress=self.compress,
            level=self.level,
            shuffle_width=self.shuffle,
        )

    def footprint(self, records: Sequence[tuple[BlockKey, bytes]]) -> int:
        """Bytes ``records`` would occupy in the engine (what ``used`` grows by if new)."""
        return sum(self.engine.footprint(len(key), len(record)) for key, record in records)

    def write_many(self, records: Sequence[tuple[BlockKey, bytes]]) -> None:
        """Store encoded records in one engine batch, then account for them. Raises
        StoreFullError / StorageEngineError with nothing accounted."""
        if not records:
            return
        self.engine.put_many(records)
        for key, record in records:
            size = self.engine.footprint(len(key), len(record))
            self.used += size - self.sizes.get(key, 0)
            self.sizes[key] = size

    def delete_many(self, keys: Sequence[BlockKey]) -> None:
        """Delete records (accounting first: a record we cannot delete is not ours anymore)."""
        present = [k for k in keys if k in self.sizes]
        for key in present:
            self.used -= self.sizes.pop(key)
        if present:
            self.engine.delete_many(present)

    def read_into(self, key: BlockKey, dst: np.ndarray) -> bool:
        """Decode ``key``'s record into ``dst`` and verify it. False if the record is absent;
        raises ChecksumError if it is corrupted, truncated or another key's record."""
        found = self.engine.read(key, lambda record: codec.decode_record_into(record, dst, key))
        return found is not None

    def adopt(self) -> Iterator[AdoptedRecord]:
        """Scan the engine: yield every valid record (accounted), delete and log corrupt ones.
        Returns through ``corrupt_keys`` the keys it deleted."""
        self.corrupt_keys: list[bytes] = []
        for key, record in self.engine.scan():
            try:
                if len(key) != KEY_BYTES:
                    raise ChecksumError(f"key of {len(key)} bytes")
                header = codec.decode_header(record)
            except ChecksumError as exc:
                logger.warning("ssd adopt: dropping corrupt record key=%s: %s", key.hex(), exc)
                self.corrupt_keys.append(key)
                continue
            bkey = BlockKey(key)
            size = self.engine.footprint(len(key), len(record))
            self.sizes[bkey] = size
            self.used += size
            yield AdoptedRecord(key=bkey, header=header, size=size)
        if self.corrupt_keys:
            self.engine.delete_many(self.corrupt_keys)
