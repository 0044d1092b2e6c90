"""MemoryEngine: a dict behind a lock; the reference implementation, for tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvflow.kvdb.engines.base import StorageEngine
from kvflow.kvdb.errors import StoreClosedError


class MemoryEngine(StorageEngine):
    """Volatile, thread-safe. ``path`` is ignored; nothing survives ``close``."""

    name = "memory"

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] | None = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: Path | None, map_size_bytes: int) -> MemoryEngine:
        return cls()

    def _live(self) -> dict[bytes, bytes]:
        if self._data is None:
            raise StoreClosedError("memory engine is closed")
        return self._data

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            return self._live().get(bytes(key))

    def put(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._live()[bytes(key)] = bytes(value)

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        with self._lock:
            data = self._live()
            for key, value in items:
                data[bytes(key)] = bytes(value)

    def delete(self, key: bytes) -> None:
        with self._lock:
            self._live().pop(bytes(key), None)

    def scan(self) -> Iterator[tuple[bytes, bytes]]:
        with self._lock:
            items = sorted(self._live().items())
        yield from items

    def close(self) -> None:
        with self._lock:
            self._data = None
