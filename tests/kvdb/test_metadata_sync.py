"""MetadataSync batching and replica counts read from the metadata group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.kvdb import MetadataReplicas, MetadataSync, NodeId, Tier
from kvflow.replication import MetadataConfig, MetadataGroup
from tests.conftest import pick_free_port
from tests.kvdb.conftest import ShardFactory, keys, value

NODE = NodeId("node-a")


@pytest.fixture
def group() -> Iterator[MetadataGroup]:
    g = MetadataGroup(
        MetadataConfig(
            self_address=f"127.0.0.1:{pick_free_port()}",
            append_entries_period_s=0.05,
            raft_min_timeout_s=0.25,
            raft_max_timeout_s=0.6,
        )
    )
    g.start()
    g.wait_ready(10.0)
    yield g
    g.close()


def test_one_entry_per_flush_with_collapsed_events(
    make_shard: ShardFactory, group: MetadataGroup, tmp_path: Path
) -> None:
    shard = make_shard()
    sync = MetadataSync(shard, group, NODE, interval_s=600.0)
    view = group.view()
    ks = keys(12)
    start = view.commands_applied()
    assert sync.flush() == 0 and view.commands_applied() == start  # nothing: no entry
    for i, key in enumerate(ks):
        shard.put(key, value(i), ks[i - 1] if i else None)
    shard.remove(ks[11])
    assert sync.flush() == 12
    assert view.commands_applied() == start + 1
    assert view.blocks_on(NODE) == 11
    assert view.replicas(ks[11]) == {}
    ssd = [k for k in ks[:11] if shard.tier_of(k) is Tier.SSD]
    assert ssd and all(view.replicas(k) == {NODE: Tier.SSD} for k in ssd)
    sync.close()


def test_background_flusher_and_readopt(make_shard: ShardFactory, group: MetadataGroup) -> None:
    shard = make_shard()
    sync = MetadataSync(shard, group, NODE, interval_s=0.02)
    sync.start()
    ks = keys(3)
    for i, key in enumerate(ks):
        shard.put(key, value(i))
    sync.close()  # stops the thread and flushes what is left
    assert group.view().blocks_on(NODE) == 3
    group.record_batch(NODE, [(keys(1, "tenant-b")[0], Tier.DRAM)], [], 1.0)  # stale fact
    assert MetadataSync(shard, group, NODE).readopt() == 3
    assert sorted(group.view().keys_on(NODE)) == sorted(ks)


def test_blocks_replicated_elsewhere_are_dropped_not_demoted(
    make_shard: ShardFactory, group: MetadataGroup
) -> None:
    ks = keys(9)
    group.record_batch(NodeId("node-b"), [(ks[2], Tier.DRAM)], [], 1.0)
    shard = make_shard(replicas=MetadataReplicas(group.view(), NodeId("local")))
    for i, key in enumerate(ks):
        shard.put(key, value(i))
    # victims (unchained, LRU among leaves): k2 first (replica on node-b: dropped), k0, k1
    assert [shard.tier_of(k) for k in ks[:4]] == [Tier.SSD, Tier.SSD, None, Tier.DRAM]
