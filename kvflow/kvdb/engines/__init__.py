"""SSD-tier storage engines behind one interface, picked by name from ``ENGINES``."""

from __future__ import annotations

from kvflow.kvdb.engines.base import StorageEngine
from kvflow.kvdb.engines.lmdb_engine import LmdbEngine
from kvflow.kvdb.engines.memory import MemoryEngine
from kvflow.kvdb.engines.rocks import RocksEngine

ENGINES: dict[str, type[StorageEngine]] = {
    RocksEngine.name: RocksEngine,
    LmdbEngine.name: LmdbEngine,
    MemoryEngine.name: MemoryEngine,
}

__all__ = ["ENGINES", "LmdbEngine", "MemoryEngine", "RocksEngine", "StorageEngine"]
