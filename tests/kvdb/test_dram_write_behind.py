"""The DRAM tier's write-behind (``Shard.write_behind``, ``TierMover.write_behind``): once the
tier is half full, the blocks an eviction would demote are written to SSD ahead of it, coldest
first, and stay in DRAM; the eviction that picks them later writes nothing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvflow.kvdb import StoreConfig
from kvflow.kvdb.replicas import ReplicaCounter
from kvflow.replication import Tier
from tests.kvdb.conftest import NBYTES, RECORD, value

# DRAM for 8 blocks (conftest), evicting at 8 down to 6; half full from 4 blocks.


def independent_keys(n: int) -> list[bytes]:
    """``n`` distinct keys, none the parent of another (each its own leaf)."""
    return [bytes([i + 1]) * 16 for i in range(n)]


def ssd_writes(shard) -> int:
    return shard.stats().ssd.bytes_written


def read(shard, key: bytes) -> tuple[Tier | None, np.ndarray]:
    out = np.zeros(NBYTES, dtype=np.uint8)
    return shard.get_into(key, out), out


def test_nothing_before_the_tier_is_half_full_then_coldest_first(make_shard) -> None:
    shard = make_shard(dram_write_behind=True, eviction="lru")
    ks = independent_keys(5)
    for i, k in enumerate(ks[:3]):
        shard.put(k, value(i))
    assert shard.write_behind() == 0 and ssd_writes(shard) == 0  # 3 of 8: not yet
    shard.put(ks[3], value(3))
    read(shard, ks[0])  # block 0 is now the most recently used
    written = [shard.write_behind(chunk=1) for _ in range(5)]  # one block a call
    assert written == [NBYTES, NBYTES, NBYTES, NBYTES, 0]
    assert ssd_writes(shard) == 4 * RECORD
    # every block still served from DRAM, bytes unchanged
    for i, k in enumerate(ks[:4]):
        tier, out = read(shard, k)
        assert tier is Tier.DRAM and (out == value(i)).all()
    # a new block joins the plan once the last plan is used up
    shard.put(ks[4], value(4))
    assert shard.write_behind() == NBYTES and shard.write_behind() == 0


def test_the_order_is_the_evictions(make_shard) -> None:
    shard = make_shard(dram_write_behind=True, eviction="lru", dram_capacity_bytes=8 * NBYTES)
    ks = independent_keys(6)
    for i, k in enumerate(ks):
        shard.put(k, value(i))
    read(shard, ks[0])
    read(shard, ks[1])  # the coldest are now 2, 3, 4, 5, 0, 1
    shard.write_behind(chunk=2 * NBYTES)  # two blocks: 2 and 3
    shard.evict(Tier.DRAM, 2 * NBYTES)  # the eviction picks the same two: nothing written
    assert ssd_writes(shard) == 2 * RECORD
    for k in ks[2:4]:
        assert read(shard, k)[0] is Tier.SSD
    shard.evict(Tier.DRAM, NBYTES)  # block 4 was not written behind: the eviction writes it
    assert ssd_writes(shard) == 3 * RECORD
    tier, out = read(shard, ks[4])
    assert tier is Tier.SSD and (out == value(4)).all()


def test_an_eviction_under_load_writes_nothing_after_it(make_shard) -> None:
    shard = make_shard(dram_write_behind=True, eviction="lru")
    ks = independent_keys(12)
    for i, k in enumerate(ks[:7]):
        shard.put(k, value(i))
    while shard.write_behind():
        pass
    before = ssd_writes(shard)
    assert before == 7 * RECORD
    for i, k in enumerate(ks[7:], start=7):  # past the high watermark: evictions
        assert shard.put(k, value(i)) is Tier.DRAM
    assert ssd_writes(shard) == before  # the victims were on SSD already
    stats = shard.stats()
    assert stats.dram.demotions >= 5
    for i, k in enumerate(ks):  # nothing lost: each block in one tier or the other
        tier, out = read(shard, k)
        assert tier is not None and (out == value(i)).all()


def test_removed_blocks_leave_no_record(make_shard) -> None:
    shard = make_shard(dram_write_behind=True, eviction="lru")
    ks = independent_keys(5)
    for i, k in enumerate(ks):
        shard.put(k, value(i))
    while shard.write_behind():
        pass
    assert shard.stats().ssd.used_bytes == 5 * RECORD
    assert shard.remove(ks[0])
    assert shard.stats().ssd.used_bytes == 4 * RECORD
    assert read(shard, ks[0])[0] is None


class TwoCopies(ReplicaCounter):
    """Every block in ``replicated`` has a copy on another node too."""

    def __init__(self, replicated: set[bytes]) -> None:
        self.replicated = replicated

    def replica_counts(self, keys: Sequence[bytes]) -> list[int]:
        return [2 if k in self.replicated else 1 for k in keys]


def test_a_block_an_eviction_would_drop_is_not_written(make_shard) -> None:
    ks = independent_keys(5)
    shard = make_shard(dram_write_behind=True, replicas=TwoCopies({ks[1], ks[3]}))
    for i, k in enumerate(ks):
        shard.put(k, value(i))
    while shard.write_behind():
        pass
    assert ssd_writes(shard) == 3 * RECORD  # blocks 0, 2, 4: last copies


def test_nothing_past_the_ssd_high_watermark(make_shard) -> None:
    shard = make_shard(
        dram_write_behind=True, eviction="lru", ssd_capacity_bytes=3 * RECORD, high_watermark=1.0
    )
    ks = independent_keys(5)
    for i, k in enumerate(ks):
        shard.put(k, value(i))
    while shard.write_behind(chunk=1):
        pass
    assert ssd_writes(shard) == 3 * RECORD  # no SSD record dropped to make room
    assert all(read(shard, k)[0] is Tier.DRAM for k in ks)


def test_off_by_default_and_when_closed(make_shard) -> None:
    assert StoreConfig(engine="memory").dram_write_behind is False
    with pytest.raises(ValueError, match="dram_write_behind must be a bool"):
        StoreConfig(engine="memory", dram_write_behind=1)  # type: ignore[arg-type]
    off = make_shard(eviction="lru")
    for i, k in enumerate(independent_keys(6)):
        off.put(k, value(i))
    assert off.write_behind() == 0 and ssd_writes(off) == 0
    on = make_shard(dram_write_behind=True, ssd_capacity_bytes=0)  # no SSD tier
    for i, k in enumerate(independent_keys(6)):
        on.put(k, value(i))
    assert on.write_behind() == 0
    closing = make_shard(dram_write_behind=True, eviction="lru")
    for i, k in enumerate(independent_keys(6)):
        closing.put(k, value(i))
    closing.close()
    assert closing.write_behind() == 0
