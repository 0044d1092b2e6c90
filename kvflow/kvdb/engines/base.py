"""StorageEngine: the SSD tier's byte store behind one small interface.

Engines are thin byte stores: no accounting, no checksums, no codec (those live in
``kvdb.ssd``). Contract for every implementation:

- Keys and values are bytes; ``put`` overwrites; ``delete`` of a missing key is a no-op.
- ``get`` returns a new ``bytes`` owned by the caller, or None.
- ``read(key, consume)`` calls ``consume(view)`` with the value and returns its result (None
  if absent). ``view`` is only valid inside ``consume`` (an engine may pass a zero-copy view
  of its own memory, e.g. LMDB's mmap); ``consume`` must copy out what it keeps.
- ``put_many``/``delete_many`` are atomic batches where the engine supports it.
- All methods are thread-safe. After ``close`` (idempotent) every call raises StoreClosedError.
- A full device raises ``StoreFullError``; other engine failures raise ``StorageEngineError``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class StorageEngine(abc.ABC):
    """An ordered or unordered key -> bytes store on local disk (or memory, for tests)."""

    name: str = "abstract"

    @classmethod
    @abc.abstractmethod
    def open(cls, path: Path | None, map_size_bytes: int) -> StorageEngine:
        """Open (creating if needed) the store at ``path``. ``map_size_bytes`` bounds engines
        that preallocate an address range (LMDB); others ignore it."""

    @abc.abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The value of ``key`` as new bytes, or None."""

    def read(self, key: bytes, consume: Callable[[bytes | memoryview], T]) -> T | None:
        """``consume(value)`` for the value of ``key`` (None if absent); see module doc."""
        value = self.get(key)
        return None if value is None else consume(value)

    @abc.abstractmethod
    def put(self, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwrite)."""

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store several values; engines override this with one atomic batch."""
        for key, value in items:
            self.put(key, value)

    @abc.abstractmethod
    def delete(self, key: bytes) -> None:
        """Remove ``key`` if present."""

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """Remove several keys; engines override this with one atomic batch."""
        for key in keys:
            self.delete(key)

    @abc.abstractmethod
    def scan(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) pair. Values are new bytes. Concurrent writes may or may not be
        seen."""

    def footprint(self, key_len: int, value_len: int) -> int:
        """Bytes a record of these sizes occupies in the engine's files, as the tier accounts
        them. Engines that pack records (RocksDB's SST blocks, memory) count the value."""
        del key_len
        return value_len

    def flush(self) -> None:  # noqa: B027 - optional hook: engines without buffers do nothing
        """Move buffered writes to the engine's files (RocksDB memtable -> SST, LMDB sync)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release the store (idempotent)."""
