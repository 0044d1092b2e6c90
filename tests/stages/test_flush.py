"""runtime.remove_unpinned over a real shard: every block removed but the pinned ones, in
every tier, each removal in the outbox (the metadata follows)."""

from __future__ import annotations

from kvflow.kvdb import BlockRemoved, Tier
from kvflow.stages.runtime.flush import FlushResult, remove_unpinned
from tests.kvdb.conftest import ShardFactory, keys, make_shard, value  # noqa: F401 - the fixture


def test_removes_every_unpinned_block_and_keeps_the_pinned(
    make_shard: ShardFactory,  # noqa: F811 - the fixture
) -> None:
    shard = make_shard()
    ks = keys(6)
    for i, k in enumerate(ks):
        shard.put(k, value(i))
    shard.evict(Tier.DRAM, 1 << 30)  # some blocks only on SSD
    shard.put(ks[0], value(0))
    assert shard.pin(ks[4:]) == [True, True]
    shard.events.take()
    assert remove_unpinned(shard) == FlushResult(removed=4, pinned=2)
    removed = [e.key for e in shard.events.take() if isinstance(e, BlockRemoved)]
    assert sorted(removed) == sorted(ks[:4])
    assert sorted(k for k, _ in shard.holdings()) == sorted(ks[4:])
    assert remove_unpinned(make_shard()) == FlushResult(removed=0, pinned=0)
    shard.unpin(ks[4:])
    assert remove_unpinned(shard) == FlushResult(removed=2, pinned=0)
    assert shard.holdings() == []
