"""RocksEngine: RocksDB through rocksdict (raw bytes mode); the SSD engine before LMDB became the
default (``kvdb/config.py:DEFAULT_ENGINE``).

Puts skip RocksDB's write-ahead log. A record is a copy of a block the node also held in DRAM
(or can recompute), and the log doubled the CPU of every demotion: 3.3-3.5 against 1.4 ms of
CPU per MiB of 2.8 MiB records (BENCHMARKS.md, "The SSD tier's write path"). What a process
crash loses is what was in the memtables (up to two write buffers of the latest records):
those blocks are absent after the restart, never damaged, as DRAM's are. Deletes keep the log,
so a record once deleted (evicted, removed by a client) never comes back. ``close`` flushes the
memtables, so a clean shutdown keeps everything.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from rocksdict import DBCompressionType, Options, Rdict, WriteBatch, WriteOptions

from kvflow.kvdb.engines.base import StorageEngine
from kvflow.kvdb.errors import StorageEngineError, StoreClosedError, StoreFullError

logger = logging.getLogger(__name__)


def _raise(exc: Exception, what: str) -> NoReturn:
    text = str(exc)
    if "No space left" in text or "ENOSPC" in text:
        raise StoreFullError(f"rocksdb {what}: device full: {text}") from exc
    raise StorageEngineError(f"rocksdb {what} failed: {text}") from exc


class RocksEngine(StorageEngine):
    """RocksDB in ``path`` (a directory). rocksdict's Rdict is thread-safe; ``close`` takes a
    lock so no call runs against a closed handle."""

    name = "rocksdb"

    def __init__(self, path: Path) -> None:
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        # kvdb compresses (zstd + shuffle) and checksums records itself; RocksDB's own block
        # compression would only cost CPU on every read
        options.set_compression_type(DBCompressionType.none())
        try:
            self._db: Rdict | None = Rdict(str(path), options)
        except Exception as exc:  # rocksdict raises plain Exception
            _raise(exc, f"open {path}")
        self._closing = threading.RLock()
        self._unlogged = WriteOptions()
        self._unlogged.disable_wal = True

    @classmethod
    def open(cls, path: Path | None, map_size_bytes: int) -> RocksEngine:
        if path is None:
            raise ValueError("rocksdb engine needs a path")
        path.mkdir(parents=True, exist_ok=True)
        return cls(path)

    def _live(self) -> Rdict:
        if self._db is None:
            raise StoreClosedError("rocksdb engine is closed")
        return self._db

    def get(self, key: bytes) -> bytes | None:
        db = self._live()
        try:
            value = db.get(key)
        except Exception as exc:
            _raise(exc, "get")
        return None if value is None else bytes(value)

    def put(self, key: bytes, value: bytes) -> None:
        db = self._live()
        try:
            db.put(key, value, self._unlogged)
        except Exception as exc:
            _raise(exc, "put")

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        db = self._live()
        batch = WriteBatch(raw_mode=True)
        for key, value in items:
            batch.put(key, value)
        try:
            db.write(batch, self._unlogged)
        except Exception as exc:
            _raise(exc, "write batch")

    def delete(self, key: bytes) -> None:
        db = self._live()
        try:
            db.delete(key)
        except Exception as exc:
            _raise(exc, "delete")

    def delete_many(self, keys: Sequence[bytes]) -> None:
        db = self._live()
        batch = WriteBatch(raw_mode=True)
        for key in keys:
            batch.delete(key)
        try:
            db.write(batch)
        except Exception as exc:
            _raise(exc, "delete batch")

    def scan(self) -> Iterator[tuple[bytes, bytes]]:
        it = self._live().iter()
        it.seek_to_first()
        while it.valid():
            yield bytes(it.key()), bytes(it.value())
            it.next()
        error: Exception | None = None
        try:
            it.status()  # an iterator stops at a damaged file; its status says so
        except Exception as exc:
            error = exc
        del it  # the traceback keeps this frame: the iterator must not keep the DB open
        if error is not None:
            _raise(error, "scan")

    def flush(self) -> None:
        try:
            self._live().flush(True)
        except StoreClosedError:
            raise
        except Exception as exc:
            _raise(exc, "flush")

    def close(self) -> None:
        with self._closing:
            db, self._db = self._db, None
            if db is not None:
                try:
                    db.flush(True)  # the unlogged puts' memtables, before the handle goes
                except Exception:  # rocksdict raises plain Exception; the close goes on
                    logger.exception("rocksdb: flush on close failed; unflushed records lost")
                db.close()
