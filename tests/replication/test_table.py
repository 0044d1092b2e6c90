"""The pure state machine, driven by hand with explicit times."""

from __future__ import annotations

import pytest

from kvflow.replication import MetadataTable, MetadataView, NodeId, NodeInfo, Tier

A, B, C = NodeId("node-a"), NodeId("node-b"), NodeId("node-c")


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_record_batch_stores_and_removes_exactly() -> None:
    table = MetadataTable()
    table.record_batch(A, [(key(1), Tier.DRAM), (key(2), Tier.SSD)], [], now=10.0)
    table.record_batch(B, [(key(1), Tier.SSD)], [], now=11.0)

    assert table.replicas(key(1)) == {A: Tier.DRAM, B: Tier.SSD}
    assert table.replicas(key(2)) == {A: Tier.SSD}
    assert table.replicas(key(3)) == {}
    assert table.num_blocks() == 2
    assert table.blocks_on(A) == 2 and table.blocks_on(B) == 1
    assert table.keys_on(A) == [key(1), key(2)]

    # a demotion is a store with the new tier; removing an unheld key is a no-op
    table.record_batch(A, [(key(1), Tier.SSD)], [key(2), key(9)], now=12.0)
    assert table.replicas(key(1)) == {A: Tier.SSD, B: Tier.SSD}
    assert table.replicas(key(2)) == {}
    assert table.num_blocks() == 1
    assert table.keys_on(A) == [key(1)]
    assert table.tier_of(key(1), B) is Tier.SSD
    assert table.tier_of(key(2), A) is None
    assert table.commands_applied == 3
    assert table.clock == 12.0


def test_store_then_remove_in_one_batch_ends_removed() -> None:
    table = MetadataTable()
    table.record_batch(A, [(key(1), Tier.DRAM)], [key(1)], now=1.0)
    assert table.replicas(key(1)) == {}
    assert table.blocks_on(A) == 0


def test_commands_are_idempotent() -> None:
    once, twice = MetadataTable(), MetadataTable()
    batch = [(key(i), Tier.DRAM) for i in range(5)]
    once.record_batch(A, batch, [key(3)], now=1.0)
    for _ in range(2):
        twice.record_batch(A, batch, [key(3)], now=1.0)
    assert once.holders([key(i) for i in range(5)]) == twice.holders([key(i) for i in range(5)])


def test_write_registers_unknown_node_and_counts_as_heartbeat() -> None:
    table = MetadataTable()
    table.record_batch(A, [(key(1), Tier.DRAM)], [], now=5.0)
    assert table.nodes() == [NodeInfo(A, "", "", 5.0, 5.0, 1)]
    table.register_node(A, "10.0.0.1:7000", "prefill", now=6.0)
    table.record_batch(A, [], [], now=7.5)
    assert table.nodes() == [NodeInfo(A, "10.0.0.1:7000", "prefill", 5.0, 7.5, 1)]


def test_heartbeat_never_moves_back_and_reports_unknown() -> None:
    table = MetadataTable()
    assert table.heartbeat(A, now=3.0) is False
    assert table.heartbeat(A, now=9.0) is True
    assert table.heartbeat(A, now=4.0) is True  # a late, older heartbeat
    info = table.node_info(A)
    assert info is not None and info.last_heartbeat == 9.0


def test_replace_holdings_replaces_only_that_node() -> None:
    table = MetadataTable()
    table.record_batch(A, [(key(1), Tier.DRAM), (key(2), Tier.DRAM)], [], now=1.0)
    table.record_batch(B, [(key(2), Tier.SSD)], [], now=1.0)
    table.replace_holdings(A, [(key(2), Tier.SSD), (key(3), Tier.DRAM)], now=2.0)
    assert table.replicas(key(1)) == {}
    assert table.replicas(key(2)) == {A: Tier.SSD, B: Tier.SSD}
    assert table.replicas(key(3)) == {A: Tier.DRAM}
    assert table.keys_on(A) == [key(2), key(3)]
    table.replace_holdings(A, [], now=3.0)
    assert table.blocks_on(A) == 0
    assert table.replicas(key(2)) == {B: Tier.SSD}


def test_reap_drops_dead_nodes_and_their_replicas() -> None:
    table = MetadataTable()
    table.register_node(A, "a:1", "prefill", now=0.0)
    table.register_node(B, "b:1", "decode", now=0.0)
    table.register_node(C, "c:1", "prefill", now=0.0)
    table.record_batch(A, [(key(1), Tier.DRAM), (key(2), Tier.DRAM)], [], now=1.0)
    table.record_batch(B, [(key(1), Tier.SSD)], [], now=1.0)
    table.set_replica_target(key(2), 3, now=1.0)
    table.heartbeat(B, now=8.0)
    table.heartbeat(C, now=2.0)

    assert table.reap_dead_nodes(now=11.0, dead_after_s=10.0) == []  # A last seen at 1.0
    assert table.reap_dead_nodes(now=12.5, dead_after_s=10.0) == [A, C]
    assert [n.node for n in table.nodes()] == [B]
    assert table.replicas(key(1)) == {B: Tier.SSD}
    assert table.replicas(key(2)) == {}
    assert table.replica_target(key(2)) == 1  # target went with the last replica
    assert table.blocks_on(A) == 0
    # a reaped node that comes back is unknown, then re-adopts its blocks
    assert table.heartbeat(A, now=13.0) is False
    table.replace_holdings(A, [(key(2), Tier.SSD)], now=13.0)
    assert table.replicas(key(2)) == {A: Tier.SSD}


def test_replica_targets_and_under_replicated() -> None:
    table = MetadataTable()
    assert table.replica_target(key(1)) == 1
    table.set_replica_target(key(1), 3, now=0.0)
    table.set_replica_target(key(2), 2, now=0.0)
    table.record_batch(A, [(key(1), Tier.DRAM), (key(2), Tier.DRAM)], [], now=0.0)
    table.record_batch(B, [(key(2), Tier.DRAM)], [], now=0.0)
    assert table.replica_target(key(1)) == 3
    assert table.under_replicated(limit=10) == [(key(1), 1, 3)]
    table.set_replica_target(key(1), 1, now=1.0)
    assert table.replica_target(key(1)) == 1
    assert table.under_replicated(limit=10) == []


def test_bad_input_is_rejected_and_changes_nothing() -> None:
    table = MetadataTable()
    table.record_batch(A, [(key(1), Tier.DRAM)], [], now=1.0)
    with pytest.raises(TypeError, match=r"stored\[1\]: tier must be a Tier"):
        table.record_batch(A, [(key(2), Tier.DRAM), (key(3), 1)], [], now=2.0)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"stored\[0\] key: expected bytes"):
        table.record_batch(A, [("k", Tier.DRAM)], [], now=2.0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"removed\[0\]: length"):
        table.record_batch(A, [], [b""], now=2.0)
    with pytest.raises(TypeError, match="removed: expected a sequence"):
        table.record_batch(A, [], key(1), now=2.0)
    with pytest.raises(ValueError, match="node: expected a non-empty str"):
        table.record_batch(NodeId(""), [], [], now=2.0)
    with pytest.raises(ValueError, match="now: expected a finite"):
        table.record_batch(A, [], [], now=float("nan"))
    with pytest.raises(ValueError, match="n: replica target"):
        table.set_replica_target(key(1), 0, now=2.0)
    with pytest.raises(ValueError, match="dead_after_s"):
        table.reap_dead_nodes(now=2.0, dead_after_s=0.0)
    assert table.keys_on(A) == [key(1)]
    assert table.num_blocks() == 1
    assert table.commands_applied == 1


def test_snapshot_restore_round_trip() -> None:
    table = MetadataTable()
    table.register_node(A, "a:1", "prefill", now=1.0)
    table.record_batch(A, [(key(1), Tier.DRAM), (key(2), Tier.SSD)], [], now=2.0)
    table.record_batch(B, [(key(2), Tier.DRAM)], [], now=3.0)
    table.set_replica_target(key(2), 2, now=3.0)
    copy = MetadataTable()
    copy.restore(table.snapshot())
    assert copy.nodes() == table.nodes()
    assert copy.holders([key(1), key(2)]) == table.holders([key(1), key(2)])
    assert copy.keys_on(A) == table.keys_on(A)
    assert copy.replica_target(key(2)) == 2
    assert copy.commands_applied == table.commands_applied
    with pytest.raises(ValueError, match="snapshot: unsupported version"):
        copy.restore({"version": 99})


def test_view_of_table_reads_and_returns_copies() -> None:
    table = MetadataTable()
    table.record_batch(A, [(key(1), Tier.DRAM)], [], now=1.0)
    view = MetadataView.of_table(table)
    got = view.replicas(key(1))
    got[B] = Tier.SSD  # mutating the result does not touch the table
    assert view.replicas(key(1)) == {A: Tier.DRAM}
    assert view.holders([key(1), key(2)]) == [{A: Tier.DRAM}, {}]
    assert view.replica_count(key(1)) == 1
    assert view.blocks_on(A) == 1 and view.keys_on(A) == [key(1)]
    assert view.num_blocks() == 1
    assert view.is_leader() is False and view.leader() is None
