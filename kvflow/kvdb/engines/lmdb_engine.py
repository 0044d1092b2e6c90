"""LmdbEngine: LMDB (memory-mapped B+tree); reads are zero-copy views of the map."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import lmdb

from kvflow.kvdb.engines.base import StorageEngine
from kvflow.kvdb.errors import StorageEngineError, StoreClosedError, StoreFullError

T = TypeVar("T")

# LMDB's layout (mdb.c): a leaf node is an 8-byte header + key + value plus a 2-byte slot; a
# node larger than ``me_nodemax`` = ((psize - 16) // 2 & ~1) - 2 keeps its value on overflow
# pages of its own, ceil((16 + value) / psize) of them, and an 8-byte page number in the leaf.
_NODE_HEADER = 8
_PAGE_HEADER = 16
_SLOT = 2


def _raise(exc: Exception, what: str) -> NoReturn:
    if isinstance(exc, lmdb.MapFullError) or (
        isinstance(exc, OSError | lmdb.DiskError) and "No space" in str(exc)
    ):
        raise StoreFullError(f"lmdb {what}: map or device full: {exc}") from exc
    raise StorageEngineError(f"lmdb {what} failed: {exc}") from exc


class LmdbEngine(StorageEngine):
    """LMDB environment in directory ``path`` with a fixed map size. Writers are serialised by
    LMDB; readers run concurrently. Durability: writes are not fsynced per transaction; ``close``
    syncs."""

    name = "lmdb"

    def __init__(self, path: Path, map_size_bytes: int) -> None:
        try:
            self._env: lmdb.Environment | None = lmdb.open(
                str(path),
                map_size=map_size_bytes,
                subdir=True,
                sync=False,
                metasync=False,
                readahead=False,
                max_readers=512,
                lock=True,
            )
        except lmdb.Error as exc:
            _raise(exc, f"open {path}")
        self._psize = int(self._env.stat()["psize"])
        self._nodemax = (((self._psize - _PAGE_HEADER) // 2) & ~1) - _SLOT

    @classmethod
    def open(cls, path: Path | None, map_size_bytes: int) -> LmdbEngine:
        if path is None:
            raise ValueError("lmdb engine needs a path")
        path.mkdir(parents=True, exist_ok=True)
        return cls(path, map_size_bytes)

    def _live(self) -> lmdb.Environment:
        if self._env is None:
            raise StoreClosedError("lmdb engine is closed")
        return self._env

    def footprint(self, key_len: int, value_len: int) -> int:
        """A value too large for a leaf node takes whole overflow pages: a 2,100-byte record
        occupies 4,096 bytes, a 4,100-byte one 8,192. A leaf record counts its node; leaf pages
        are at least half full, which the map's slack (2x the tier's capacity) covers."""
        node = _NODE_HEADER + key_len + value_len
        if node <= self._nodemax:
            return node + _SLOT
        pages = -(-(_PAGE_HEADER + value_len) // self._psize)
        return _NODE_HEADER + key_len + 8 + _SLOT + pages * self._psize

    def get(self, key: bytes) -> bytes | None:
        try:
            with self._live().begin(buffers=False) as txn:
                value = txn.get(key)
        except lmdb.Error as exc:
            _raise(exc, "get")
        return None if value is None else bytes(value)

    def read(self, key: bytes, consume: Callable[[bytes | memoryview], T]) -> T | None:
        try:
            with self._live().begin(buffers=True) as txn:
                value = txn.get(key)
                return None if value is None else consume(value)
        except lmdb.Error as exc:
            _raise(exc, "read")

    def put(self, key: bytes, value: bytes) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        try:
            with self._live().begin(write=True) as txn:
                for key, value in items:
                    txn.put(key, value)
        except (lmdb.Error, OSError) as exc:
            _raise(exc, "put")

    def delete(self, key: bytes) -> None:
        self.delete_many([key])

    def delete_many(self, keys: Sequence[bytes]) -> None:
        try:
            with self._live().begin(write=True) as txn:
                for key in keys:
                    txn.delete(key)
        except lmdb.Error as exc:
            _raise(exc, "delete")

    def scan(self) -> Iterator[tuple[bytes, bytes]]:
        try:
            with self._live().begin(buffers=False) as txn:
                for key, value in txn.cursor():
                    yield bytes(key), bytes(value)
        except lmdb.Error as exc:
            _raise(exc, "scan")

    def flush(self) -> None:
        try:
            self._live().sync(True)
        except lmdb.Error as exc:
            _raise(exc, "sync")

    def close(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            env.sync(True)
            env.close()
