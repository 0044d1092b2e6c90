"""Tier moves, eviction orders on a real shard, pins."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.kvdb import BlockRemoved, BlockStored, ReplicaCounter, Tier
from tests.kvdb.conftest import NBYTES, ShardFactory, keys, value


class FixedReplicas(ReplicaCounter):
    def __init__(self, counts: dict[bytes, int]) -> None:
        self.counts = counts

    def replica_counts(self, keys: Sequence[bytes]) -> list[int]:
        return [self.counts.get(k, 1) for k in keys]


def tiers(shard, ks):  # type: ignore[no-untyped-def]
    return [shard.tier_of(k) for k in ks]


def test_chain_demotes_leaf_first(make_shard: ShardFactory) -> None:
    shard = make_shard()
    ks = keys(9)
    for i, key in enumerate(ks):
        assert shard.put(key, value(i), ks[i - 1] if i else None) is Tier.DRAM
    # 9th put crossed the high watermark (100%): down to 75% = 6 blocks, 3 victims
    assert tiers(shard, ks) == [Tier.DRAM] * 5 + [Tier.SSD] * 3 + [Tier.DRAM]
    events = shard.take_events()
    demoted = [e.key for e in events if isinstance(e, BlockStored) and e.tier is Tier.SSD]
    assert demoted == [ks[7], ks[6], ks[5]]  # child before parent
    stats = shard.stats()
    assert stats.dram.demotions == 3 and stats.ssd.blocks == 3 and stats.dram.blocks == 6


def test_lru_demotes_least_recent(make_shard: ShardFactory) -> None:
    shard = make_shard(eviction="lru")
    ks = keys(9)
    for i, key in enumerate(ks[:8]):
        shard.put(key, value(i), ks[i - 1] if i else None)
    buf = np.empty(NBYTES, np.uint8)
    assert shard.get_into(ks[0], buf) is Tier.DRAM  # k0 becomes most recent
    shard.put(ks[8], value(8))
    assert tiers(shard, ks) == [Tier.DRAM, Tier.SSD, Tier.SSD, Tier.SSD] + [Tier.DRAM] * 5


def test_replicated_blocks_are_dropped_last_copies_demoted(make_shard: ShardFactory) -> None:
    ks = keys(9)
    shard = make_shard(replicas=FixedReplicas({ks[5]: 2}))
    for i, key in enumerate(ks):
        shard.put(key, value(i), None)  # unrelated blocks: plain LRU among leaves
    # victims: k5 (has a replica elsewhere: dropped), then k0, k1 (last copies: demoted)
    assert tiers(shard, ks) == [Tier.SSD, Tier.SSD] + [Tier.DRAM] * 3 + [None] + [Tier.DRAM] * 3
    events = shard.take_events()[8:]  # eviction runs before the 9th block is announced
    assert events[0] == BlockRemoved(ks[5])
    assert [(e.key, e.tier) for e in events[1:3]] == [(ks[0], Tier.SSD), (ks[1], Tier.SSD)]
    assert events[3] == BlockStored(ks[8], Tier.DRAM, NBYTES, None)


def test_promotion_on_hit_keeps_ssd_copy(make_shard: ShardFactory) -> None:
    shard = make_shard(eviction="lru")
    ks = keys(9)
    for i, key in enumerate(ks):
        shard.put(key, value(i))
    assert shard.tier_of(ks[0]) is Tier.SSD
    buf = np.empty(NBYTES, np.uint8)
    assert shard.get_into(ks[0], buf) is Tier.SSD
    assert np.array_equal(buf, value(0))
    assert shard.tier_of(ks[0]) is Tier.DRAM
    stats = shard.stats()
    assert stats.ssd.promotions == 1 and stats.ssd.hits == 1 and stats.dram.misses == 1
    assert stats.ssd.blocks == 3  # the SSD record is kept
    assert shard.get_into(ks[0], buf) is Tier.DRAM


def test_no_promotion_when_disabled(make_shard: ShardFactory) -> None:
    shard = make_shard(eviction="lru", promote_on_hit=False)
    ks = keys(9)
    for i, key in enumerate(ks):
        shard.put(key, value(i))
    buf = np.empty(NBYTES, np.uint8)
    assert shard.get_into(ks[0], buf) is Tier.SSD
    assert shard.get_into(ks[0], buf) is Tier.SSD
    assert shard.stats().ssd.promotions == 0


def test_ssd_overflow_drops_least_recent(make_shard: ShardFactory) -> None:
    shard = make_shard(dram_capacity_bytes=0, eviction="lru")
    ks = keys(17)
    for i, key in enumerate(ks):
        assert shard.put(key, value(i)) is Tier.SSD
    # 17th record crossed capacity (16): down to 75% = 12 records, then it is written
    assert [shard.exists(k) for k in ks] == [False] * 5 + [True] * 12
    removed = [e.key for e in shard.take_events() if isinstance(e, BlockRemoved)]
    assert removed == ks[:5]
    assert shard.stats().ssd.evictions == 5


def test_pinned_blocks_are_not_evicted(make_shard: ShardFactory) -> None:
    shard = make_shard(eviction="lru")
    ks = keys(20)
    for i, key in enumerate(ks[:8]):
        shard.put(key, value(i))
    assert shard.pin([*ks[:3], keys(1, "other")[0]]) == [True, True, True, False]
    shard.put(ks[8], value(8))
    assert tiers(shard, ks[:9]) == [Tier.DRAM] * 3 + [Tier.SSD] * 3 + [Tier.DRAM] * 3
    # fill DRAM again (8 blocks) and pin everything in it: new puts go straight to SSD
    assert shard.put(ks[9], value(9)) is Tier.DRAM
    assert shard.put(ks[10], value(10)) is Tier.DRAM
    shard.pin(ks[6:11])
    assert shard.put(ks[11], value(11)) is Tier.SSD
    shard.unpin(ks[:3])
    assert shard.put(ks[12], value(12)) is Tier.DRAM
    assert tiers(shard, ks[:3]) == [Tier.SSD] * 3  # unpinned: now the least recent


def test_everything_pinned_without_ssd_rejects(make_shard: ShardFactory) -> None:
    shard = make_shard(ssd_capacity_bytes=0)
    ks = keys(9)
    for i, key in enumerate(ks[:8]):
        shard.put(key, value(i))
    shard.pin(ks[:8])
    assert shard.put(ks[8], value(8)) is None
    assert shard.stats().rejected_puts == 1
    assert all(shard.exists(k) for k in ks[:8])


def test_dram_eviction_without_ssd_drops(make_shard: ShardFactory) -> None:
    shard = make_shard(ssd_capacity_bytes=0, eviction="lru")
    ks = keys(9)
    for i, key in enumerate(ks):
        shard.put(key, value(i))
    assert [shard.exists(k) for k in ks] == [False] * 3 + [True] * 6
    assert shard.stats().dram.evictions == 3


def test_put_existing_key_is_a_noop_refresh(make_shard: ShardFactory) -> None:
    shard = make_shard(eviction="lru")
    ks = keys(9)
    for i, key in enumerate(ks[:8]):
        shard.put(key, value(i))
    shard.take_events()
    assert shard.put(ks[0], value(0)) is Tier.DRAM
    assert shard.take_events() == []
    shard.put(ks[8], value(8))
    assert shard.tier_of(ks[0]) is Tier.DRAM and shard.tier_of(ks[1]) is Tier.SSD
