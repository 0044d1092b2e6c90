"""LmdbEngine: LMDB (memory-mapped B+tree); reads are zero-copy views of the map."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import lmdb

from kvflow.kvdb.engines.base import StorageEngine
from kvflow.kvdb.errors import StorageEngineError, StoreClosedError, StoreFullError

T = TypeVar("T")


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
