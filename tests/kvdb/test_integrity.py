"""Bad input and damaged data: clear errors, misses, nothing else lost."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvflow.kvdb import (
    BlockPinnedError,
    BlockRemoved,
    EmbeddedClient,
    IncompatibleDataDirError,
    InvalidBufferError,
    InvalidKeyError,
    Namespace,
    NamespaceMismatchError,
    NotPinnedError,
    Shard,
    StoreClosedError,
    StoreFullError,
    Tier,
    ValueSizeError,
)
from kvflow.kvdb.codec import block_checksum
from kvflow.kvdb.engines import MemoryEngine
from kvflow.kvdb.keys import DEFAULT_TENANT
from kvflow.kvdb.manifest import MANIFEST_NAME
from tests.kvdb.conftest import LAYOUT, NAMESPACE, NBYTES, ShardFactory, config, keys, value


def _fill_ssd(shard: Shard, ks: Sequence[bytes]) -> None:
    for i, key in enumerate(ks):
        assert shard.put(key, value(i)) is Tier.SSD


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_ssd_record_is_a_counted_miss(make_shard: ShardFactory, damage: str) -> None:
    engine = MemoryEngine()
    shard = make_shard(dram_capacity_bytes=0, engine=engine)
    ks = keys(3)
    _fill_ssd(shard, ks)
    record = bytearray(engine.get(ks[1]) or b"")
    if damage == "flip":
        record[100] ^= 1
    elif damage == "truncate":
        record = record[:-10]
    else:
        record = bytearray(b"not a record")
    engine.put(ks[1], bytes(record))
    shard.take_events()
    buf = np.zeros(NBYTES, np.uint8)
    assert shard.get_into(ks[1], buf) is None
    assert not shard.exists(ks[1])
    assert engine.get(ks[1]) is None  # the record is removed
    assert shard.take_events() == [BlockRemoved(ks[1])]
    assert shard.stats().ssd.corruptions == 1
    assert shard.get(ks[1]) is None
    for i in (0, 2):  # nothing else lost
        assert shard.get(ks[i]) == value(i).tobytes()


def test_corrupt_dram_block_is_a_counted_miss(make_shard: ShardFactory) -> None:
    shard = make_shard()
    ks = keys(2)
    shard.put(ks[0], value(0))
    shard.put(ks[1], value(1))
    entry = shard._state.index[ks[0]]
    assert shard._state.dram is not None and entry.dram is not None
    shard._state.dram.pool[entry.dram + 7] ^= 0xFF
    assert shard.get_into(ks[0], np.empty(NBYTES, np.uint8)) is None
    assert not shard.exists(ks[0])
    assert shard.stats().dram.corruptions == 1
    assert shard.get(ks[1]) == value(1).tobytes()


def test_unverified_dram_hits_are_one_copy_and_puts_still_checksum(
    make_shard: ShardFactory,
) -> None:
    """verify_dram_hits=False: a DRAM hit is not checksummed (the pool changes only by this
    shard's puts); the checksum is still made at put and checked where bytes can go bad."""
    shard = make_shard(verify_dram_hits=False)
    ks = keys(2)
    shard.put(ks[0], value(0))
    entry = shard._state.index[ks[0]]
    assert shard._state.dram is not None and entry.dram is not None
    buf = np.empty(NBYTES, np.uint8)
    assert shard.get_into(ks[0], buf) is Tier.DRAM and buf.tobytes() == value(0).tobytes()
    shard._state.dram.pool[entry.dram + 7] ^= 0xFF  # only a bug in this process does this
    assert shard.get_into(ks[0], buf) is Tier.DRAM and buf[7] != value(0)[7]
    assert shard.stats().dram.corruptions == 0
    assert entry.checksum == block_checksum(ks[0], None, DEFAULT_TENANT, value(0))


def test_corrupt_records_found_at_open_are_dropped(tmp_path: Path) -> None:
    cfg = config(tmp_path, engine="lmdb", dram_capacity_bytes=0)
    ks = keys(3)
    shard = Shard(cfg, NAMESPACE.fingerprint())
    _fill_ssd(shard, ks)
    shard._state.ssd.engine.put(ks[2], b"KVDB truncated")  # type: ignore[union-attr]
    shard.close()
    shard = Shard(cfg, NAMESPACE.fingerprint())
    try:
        assert [shard.exists(k) for k in ks] == [True, True, False]
        assert shard.stats().ssd.corruptions == 1
    finally:
        shard.close()


def test_wrong_sizes_keys_and_buffers(make_shard: ShardFactory) -> None:
    shard = make_shard(value_size=NBYTES)
    ks = keys(2)
    with pytest.raises(ValueSizeError, match="1023"):
        shard.put(ks[0], np.zeros(NBYTES - 1, np.uint8))
    with pytest.raises(ValueSizeError):
        shard.put(ks[0], b"")
    with pytest.raises(InvalidKeyError):
        shard.put(b"short", value(0))
    with pytest.raises(InvalidBufferError):
        shard.put(ks[0], object())
    with pytest.raises(InvalidBufferError, match="contiguous"):
        shard.put(ks[0], np.zeros((NBYTES, 2), np.uint8)[:, 0])
    shard.put(ks[0], value(0))
    with pytest.raises(ValueSizeError):
        shard.get_into(ks[0], np.empty(NBYTES + 1, np.uint8))
    with pytest.raises(InvalidBufferError, match="read-only"):
        shard.get_into(ks[0], b"x" * NBYTES)
    assert shard.get_into(ks[1], np.empty(5, np.uint8)) is None  # a miss needs no size
    assert shard.get(ks[0]) == value(0).tobytes()  # nothing was disturbed


def test_pin_errors(make_shard: ShardFactory) -> None:
    shard = make_shard()
    ks = keys(2)
    shard.put(ks[0], value(0))
    shard.pin([ks[0]])
    with pytest.raises(BlockPinnedError):
        shard.remove(ks[0])
    with pytest.raises(NotPinnedError):
        shard.unpin([ks[0], ks[0]])  # one pin only: nothing changes
    shard.unpin([ks[0]])
    with pytest.raises(NotPinnedError):
        shard.unpin([ks[0]])
    assert shard.remove(ks[0]) and not shard.remove(ks[0])


class FullDiskEngine(MemoryEngine):
    """A memory engine whose device fills up after ``room`` records."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if len(list(self.scan())) + len(items) > self.room:
            raise StoreFullError("no space left on device (test)")
        super().put_many(items)


def test_full_disk_is_a_clear_error_and_nothing_is_lost(make_shard: ShardFactory) -> None:
    shard = make_shard(engine=FullDiskEngine(room=2), eviction="lru")
    ks = keys(12)
    for i, key in enumerate(ks[:8]):
        shard.put(key, value(i))
    with pytest.raises(StoreFullError):  # the demotion of 3 blocks cannot be written
        shard.put(ks[8], value(8))
    assert not shard.exists(ks[8])
    for i, key in enumerate(ks[:8]):  # the would-be victims are still in DRAM
        assert shard.get(key) == value(i).tobytes()
    shard.remove(ks[7])
    assert shard.put(ks[8], value(8)) is Tier.DRAM  # room again, no demotion needed


def test_incompatible_data_dirs(tmp_path: Path) -> None:
    cfg = config(tmp_path, engine="rocksdb")
    Shard(cfg, NAMESPACE.fingerprint()).close()
    with pytest.raises(IncompatibleDataDirError, match="engine"):
        Shard(config(tmp_path, engine="lmdb"), NAMESPACE.fingerprint())
    with pytest.raises(NamespaceMismatchError):
        Shard(cfg, "f" * 32)
    manifest = tmp_path / "data" / MANIFEST_NAME
    body = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**body, "format_version": 99}))
    with pytest.raises(IncompatibleDataDirError, match="version 99"):
        Shard(cfg, NAMESPACE.fingerprint())
    manifest.write_text("{not json")  # damage, not a mistake: moved aside with its tier
    Shard(cfg, NAMESPACE.fingerprint()).close()  # (tests/faults/test_data_dir_damage.py)
    assert json.loads(manifest.read_text())["engine"] == "rocksdb"
    manifest.unlink()
    with pytest.raises(IncompatibleDataDirError, match="without"):
        Shard(cfg, NAMESPACE.fingerprint())


def test_an_unconfigured_engine_is_the_directorys_own_else_lmdb(tmp_path: Path) -> None:
    """The default engine changed (rocksdb -> lmdb): a directory written by either keeps its
    engine when none is configured, a new one gets lmdb, a configured one is refused with
    what to do."""
    from kvflow.kvdb.config import DEFAULT_ENGINE
    from kvflow.kvdb.manifest import engine_for

    data = tmp_path / "data"
    assert DEFAULT_ENGINE == "lmdb" and engine_for(data, None) == "lmdb"
    Shard(config(tmp_path, engine="rocksdb"), NAMESPACE.fingerprint()).close()
    assert engine_for(data, None) == "rocksdb"
    assert engine_for(data, "lmdb") == "lmdb"
    with pytest.raises(IncompatibleDataDirError, match="configure 'rocksdb'"):
        Shard(config(tmp_path, engine="lmdb"), NAMESPACE.fingerprint())
    Shard(config(tmp_path, engine=engine_for(data, None)), NAMESPACE.fingerprint()).close()
    (data / MANIFEST_NAME).write_text("{not json")
    assert engine_for(data, None) == "lmdb"  # opening it then reports the damage


def test_a_memory_tiers_directory_is_taken_over_by_a_disk_engine(tmp_path: Path) -> None:
    """A "memory" SSD tier kept nothing on disk: an unconfigured open gets the default
    engine (not a volatile tier again), and its manifest is rewritten, not refused."""
    from kvflow.kvdb.manifest import engine_for

    data = tmp_path / "data"
    Shard(config(tmp_path, engine="memory"), NAMESPACE.fingerprint()).close()
    assert engine_for(data, None) == "lmdb"
    with pytest.raises(NamespaceMismatchError):  # another model's directory stays refused
        Shard(config(tmp_path, engine="lmdb"), "f" * 32)
    Shard(config(tmp_path, engine="lmdb"), NAMESPACE.fingerprint()).close()
    assert json.loads((data / MANIFEST_NAME).read_text())["engine"] == "lmdb"


def test_client_checks_namespace_and_block_size(make_shard: ShardFactory) -> None:
    shard = make_shard()
    other_model = Namespace("tenant-a", "another-model", LAYOUT)
    with pytest.raises(NamespaceMismatchError, match="another-model"):
        EmbeddedClient(shard, other_model)
    client = EmbeddedClient(shard, NAMESPACE)
    with pytest.raises(ValueSizeError, match="block of this namespace"):
        client.put(keys(1)[0], np.zeros(NBYTES * 2, np.uint8))


def test_closed_shard_raises(make_shard: ShardFactory) -> None:
    shard = make_shard()
    shard.close()
    with pytest.raises(StoreClosedError):
        shard.put(keys(1)[0], value(0))
    with pytest.raises(StoreClosedError):
        shard.get(keys(1)[0])
