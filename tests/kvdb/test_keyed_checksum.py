"""The block checksum covers the key, the parent and the owner tenant; a pinned block lost to
corruption still owes its pins (so the holder can release them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvflow.kvdb import (
    IncompatibleDataDirError,
    NotPinnedError,
    Shard,
    Tier,
)
from kvflow.kvdb.codec import HEADER_BYTES
from kvflow.kvdb.engines import ENGINES, MemoryEngine
from kvflow.kvdb.manifest import MANIFEST_NAME
from tests.kvdb.conftest import NAMESPACE, NBYTES, ShardFactory, config, keys, value


def _fill_ssd(shard: Shard, ks: Sequence[bytes]) -> None:
    for i, key in enumerate(ks):
        parent = ks[i - 1] if i else None
        assert shard.put(key, value(i), parent=parent) is Tier.SSD


def test_a_valid_record_under_another_key_is_refused(make_shard: ShardFactory) -> None:
    engine = MemoryEngine()
    shard = make_shard(dram_capacity_bytes=0, engine=engine)
    ks = keys(3)
    _fill_ssd(shard, ks)
    engine.put(ks[2], engine.get(ks[0]) or b"")  # block 0's record, intact, under key 2
    assert shard.get(ks[2]) is None  # not block 0's bytes served as block 2
    assert not shard.exists(ks[2])
    assert shard.stats().ssd.corruptions == 1
    assert shard.get(ks[0]) == value(0).tobytes()  # the original is fine


def test_a_record_with_another_parent_is_refused(make_shard: ShardFactory) -> None:
    engine = MemoryEngine()
    shard = make_shard(dram_capacity_bytes=0, engine=engine)
    ks = keys(3)
    _fill_ssd(shard, ks)
    record = bytearray(engine.get(ks[2]) or b"")
    record[32:48] = ks[0]  # the header's parent field, rewritten
    engine.put(ks[2], bytes(record))
    assert shard.get(ks[2]) is None
    assert shard.stats().ssd.corruptions == 1


def _relabel(record: bytes) -> bytes:
    """The record with its owner tenant "tenant-a" changed to "tenant-b" (still valid)."""
    changed = bytearray(record)
    start = HEADER_BYTES + len("tenant-")
    assert changed[start : start + 1] == b"a"
    changed[start] = ord("b")
    return bytes(changed)


def test_a_record_relabelled_to_another_valid_tenant_is_a_corruption(
    make_shard: ShardFactory,
) -> None:
    """Before format 4 the tenant was outside the checksum: the relabelled block was served."""
    engine = MemoryEngine()
    shard = make_shard(dram_capacity_bytes=0, engine=engine)
    ks = keys(2, "tenant-a")
    for i, key in enumerate(ks):
        assert shard.put(key, value(i), parent=ks[i - 1] if i else None, tenant="tenant-a")
    engine.put(ks[1], _relabel(engine.get(ks[1]) or b""))
    assert shard.get(ks[1]) is None  # a miss, not block 1's bytes
    assert not shard.exists(ks[1])
    assert shard.stats().ssd.corruptions == 1
    assert shard.get(ks[0]) == value(0).tobytes()


def test_a_relabelled_record_adopted_after_a_restart_is_not_served(tmp_path: Path) -> None:
    cfg = config(tmp_path, engine="rocksdb", dram_capacity_bytes=0)
    ks = keys(2, "tenant-a")
    with Shard(cfg, NAMESPACE.fingerprint()) as shard:
        for i, key in enumerate(ks):
            shard.put(key, value(i), parent=ks[i - 1] if i else None, tenant="tenant-a")
    engine = ENGINES["rocksdb"].open(tmp_path / "data" / "ssd", cfg.ssd_capacity_bytes)
    engine.put(ks[1], _relabel(engine.get(ks[1]) or b""))
    engine.close()
    with Shard(cfg, NAMESPACE.fingerprint()) as shard:
        assert shard.get(ks[1]) is None
        assert shard.stats().ssd.corruptions == 1
        assert shard.hot(10, "tenant-b") == []  # the mislabelled block is gone from the views
        assert shard.get(ks[0]) == value(0).tobytes()


def test_pins_of_a_corrupt_block_are_released_by_unpin(make_shard: ShardFactory) -> None:
    """Before: the corrupt block left the index with its pin, unpin raised NotPinnedError and
    the valid blocks after it stayed pinned forever."""
    engine = MemoryEngine()
    shard = make_shard(dram_capacity_bytes=0, engine=engine)
    ks = keys(4)
    _fill_ssd(shard, ks)
    record = bytearray(engine.get(ks[1]) or b"")
    record[100] ^= 1
    engine.put(ks[1], bytes(record))
    assert shard.pin(ks) == [True] * 4
    bufs = [np.empty(NBYTES, np.uint8) for _ in ks]
    assert [shard.get_into(k, b) for k, b in zip(ks, bufs, strict=True)] == [
        Tier.SSD,
        None,
        Tier.SSD,
        Tier.SSD,
    ]
    assert not shard.exists(ks[1])
    assert shard.num_pinned() == 4  # three blocks, and the pin owed on the lost one
    shard.unpin(ks[1:])
    shard.unpin(ks[:1])
    assert shard.num_pinned() == 0
    with pytest.raises(NotPinnedError):
        shard.unpin([ks[1]])


def test_owed_pins_and_a_block_stored_again_share_the_count(make_shard: ShardFactory) -> None:
    engine = MemoryEngine()
    shard = make_shard(dram_capacity_bytes=0, engine=engine)
    ks = keys(2)
    _fill_ssd(shard, ks)
    engine.put(ks[1], b"KVDB garbage")
    assert shard.pin([ks[1]]) == [True]
    assert shard.get(ks[1]) is None  # dropped, one pin owed
    assert shard.put(ks[1], value(1), parent=ks[0]) is Tier.SSD  # recomputed, stored again
    assert shard.pin([ks[1]]) == [True]  # a second request pins the new block
    shard.unpin([ks[1]])  # the first request lets go (the owed pin)
    assert shard.num_pinned() == 1
    with pytest.raises(NotPinnedError):
        shard.unpin([ks[1], ks[1]])  # only one pin is left: nothing changes
    shard.unpin([ks[1]])
    assert shard.num_pinned() == 0
    assert shard.remove(ks[1])


@pytest.mark.parametrize(
    ("version", "why"),
    [
        (1, r"value only.*delete the directory"),
        (2, r"no owner tenant.*delete"),
        (3, r"do not cover the block's owner tenant.*delete"),
    ],
)
def test_an_older_data_dir_is_refused_with_the_reason(
    tmp_path: Path, version: int, why: str
) -> None:
    cfg = config(tmp_path, engine="rocksdb")
    Shard(cfg, NAMESPACE.fingerprint()).close()
    manifest = tmp_path / "data" / MANIFEST_NAME
    body = json.loads(manifest.read_text())
    assert body["format_version"] == 4
    manifest.write_text(json.dumps({**body, "format_version": version}))
    with pytest.raises(IncompatibleDataDirError, match=why):
        Shard(cfg, NAMESPACE.fingerprint())
