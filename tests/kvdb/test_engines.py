from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.kvdb.engines import ENGINES, StorageEngine
from kvflow.kvdb.errors import StoreClosedError, StoreFullError


@pytest.fixture(params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> StorageEngine:
    eng = ENGINES[request.param].open(tmp_path / "ssd", 64 << 20)
    yield eng
    eng.close()


def test_put_get_delete_scan(engine: StorageEngine) -> None:
    assert engine.get(b"a") is None
    engine.put(b"b", b"2")
    engine.put_many([(b"a", b"1"), (b"c", b"3" * 100_000)])
    engine.put(b"b", b"22")  # overwrite
    assert engine.get(b"b") == b"22"
    assert engine.read(b"c", lambda v: bytes(v[:3])) == b"333"
    assert engine.read(b"zz", len) is None
    engine.delete(b"a")
    engine.delete(b"never")  # no-op
    engine.delete_many([b"nope"])
    assert sorted(engine.scan()) == [(b"b", b"22"), (b"c", b"3" * 100_000)]


def test_closed_engine_raises(engine: StorageEngine) -> None:
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(StoreClosedError):
        engine.get(b"a")
    with pytest.raises(StoreClosedError):
        engine.put(b"a", b"1")


def test_persistent_engines_keep_data(tmp_path: Path) -> None:
    for name in ("rocksdb", "lmdb"):
        eng = ENGINES[name].open(tmp_path / name, 64 << 20)
        eng.put(b"k", b"v")
        eng.close()
        eng = ENGINES[name].open(tmp_path / name, 64 << 20)
        assert eng.get(b"k") == b"v"
        eng.close()


def test_lmdb_map_full_is_store_full(tmp_path: Path) -> None:
    eng = ENGINES["lmdb"].open(tmp_path / "small", 1 << 20)
    try:
        with pytest.raises(StoreFullError):
            for i in range(64):
                eng.put(i.to_bytes(4, "big"), bytes(64 * 1024))
        assert eng.get((0).to_bytes(4, "big")) == bytes(64 * 1024)  # earlier data intact
    finally:
        eng.close()


_CRASH = """
import os, signal, sys
from pathlib import Path
from kvflow.kvdb.engines import ENGINES
eng = ENGINES["rocksdb"].open(Path(sys.argv[1]), 0)
eng.put_many([(b"deleted", b"d" * 300_000), (b"kept", b"k" * 300_000)])
eng.flush()                                   # both on disk
eng.delete(b"deleted")                        # logged: must not come back
eng.put_many([(b"late", b"l" * 300_000)])     # unlogged, in the memtable only
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_rocksdb_after_kill_9_loses_only_unflushed_puts_and_never_revives_a_delete(
    tmp_path: Path,
) -> None:
    """Puts skip RocksDB's log (rocks.py): a SIGKILL may lose the latest records, which are
    then absent, never damaged, and a delete made before the kill stays deleted."""
    import subprocess
    import sys

    path = tmp_path / "ssd"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH, str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9 and "ready" in proc.stdout, proc.stderr
    eng = ENGINES["rocksdb"].open(path, 0)
    try:
        assert eng.get(b"kept") == b"k" * 300_000
        assert eng.get(b"deleted") is None
        assert eng.get(b"late") in (None, b"l" * 300_000)
        assert {k for k, _ in eng.scan()} <= {b"kept", b"late"}
    finally:
        eng.close()


def test_rocksdb_clean_close_keeps_unflushed_puts(tmp_path: Path) -> None:
    eng = ENGINES["rocksdb"].open(tmp_path / "ssd", 0)
    eng.put_many([(bytes([i]), bytes([i]) * 200_000) for i in range(8)])
    eng.close()
    eng = ENGINES["rocksdb"].open(tmp_path / "ssd", 0)
    try:
        assert sorted(eng.scan()) == [(bytes([i]), bytes([i]) * 200_000) for i in range(8)]
    finally:
        eng.close()
