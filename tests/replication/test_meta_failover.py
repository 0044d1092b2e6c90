"""Failures of real replica processes: the leader killed under write load, a replica restarted
from its journal, and the whole group lost and rebuilt from what the nodes hold."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable

import pytest

from kvflow.replication import NodeId, ReplicationError, Tier
from kvflow.replication.journal_guard import IDENTITY_FILE
from tests.replication.helpers import blocks, key, wait_until
from tests.replication.procs import MetaCluster

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

W = NodeId("writer")
DEADLINE_S = 30.0
BATCH = 100

ClusterFactory = Callable[[int], MetaCluster]


def _batch_keys(i: int) -> list[bytes]:
    return [key(j) for j in range(i * BATCH, (i + 1) * BATCH)]


def test_leader_killed_under_write_load_loses_no_acknowledged_write(
    meta_cluster: ClusterFactory,
) -> None:
    cluster = meta_cluster(3)
    cluster.start_all()
    leader = cluster.leader_index()
    acked: list[int] = []
    errors: list[ReplicationError] = []
    stop = threading.Event()
    client = cluster.client(timeout_s=DEADLINE_S)

    def writer() -> None:
        i = 0
        while not stop.is_set():
            try:
                client.record_batch(W, blocks(i * BATCH, (i + 1) * BATCH), [], now=float(i))
            except ReplicationError as exc:
                errors.append(exc)
            else:
                acked.append(i)
            i += 1

    thread = threading.Thread(target=writer, name="test-meta-writer")
    thread.start()
    try:
        wait_until(lambda: len(acked) >= 30, DEADLINE_S, "writes before the kill")
        cluster.kill(leader)
        at_kill = len(acked)
        wait_until(lambda: len(acked) >= at_kill + 30, DEADLINE_S, "writes after re-election")
    finally:
        stop.set()
        thread.join(DEADLINE_S)
        client.close()
    assert not thread.is_alive()
    assert errors == []  # the client retried through the election

    survivors = [i for i in range(3) if i != leader]
    assert cluster.leader_index(survivors) != leader
    expected = {k for i in acked for k in _batch_keys(i)}
    for i in survivors:
        with cluster.client([i]) as one:
            view = one.view()
            wait_until(lambda v=view: v.blocks_on(W) >= len(expected), DEADLINE_S, "applied")
            assert expected <= set(view.keys_on(W))

    # the old leader, restarted from its journal, rejoins as a follower and catches up
    cluster.start(leader)
    with cluster.client([leader]) as old:
        view = old.view()
        wait_until(lambda: expected <= set(view.keys_on(W)), DEADLINE_S, "old leader catch-up")
    cluster.leader_index()  # all three agree on one leader again


def test_replica_restarted_from_its_journal_replays_it_and_catches_up(
    meta_cluster: ClusterFactory,
) -> None:
    cluster = meta_cluster(3)
    cluster.start_all()
    leader = cluster.leader_index()
    f = next(i for i in range(3) if i != leader)
    with cluster.client() as client:
        client.record_batch(W, blocks(0, 500), [], now=1.0)
        with cluster.client([f]) as on_f:
            wait_until(lambda: on_f.view().blocks_on(W) == 500, DEADLINE_S, "replicated")
        term = int(cluster.status(f).raft_term)  # type: ignore[attr-defined]
        time.sleep(1.5)  # pysyncobj saves the commit index once a second
        cluster.kill(f)

        client.record_batch(W, blocks(500, 1000), [key(0)], now=2.0)
        client.set_replica_target(key(1), 3, now=3.0)

    # pysyncobj (>= 0.3.17) kept the term and vote beside the journal before answering votes
    meta = cluster.journal_dir(f) / "raft.journal.meta"
    assert meta.exists() and (cluster.journal_dir(f) / IDENTITY_FILE).exists()

    # Alone (no quorum, no leader) the restarted replica replays its own journal...
    others = [i for i in range(3) if i != f]
    for i in others:
        cluster.kill(i)
    cluster.start(f)
    with cluster.client([f]) as on_f:
        view = on_f.view()
        wait_until(lambda: view.blocks_on(W) == 500, DEADLINE_S, "journal replay")
        assert view.leader() is None
        assert int(cluster.status(f).raft_term) >= term  # type: ignore[attr-defined]
        # ... and catches up once the others are back and a leader is elected.
        for i in others:
            cluster.start(i)
        wait_until(lambda: view.replica_target(key(1)) == 3, DEADLINE_S, "catch-up")
        assert view.keys_on(W) == [key(j) for j in range(1, 1000)]
    cluster.leader_index()


def test_metadata_rebuilt_from_the_nodes_after_losing_every_replica(
    meta_cluster: ClusterFactory,
) -> None:
    # what two nodes hold: they know it themselves (their shards), whatever the metadata says
    a, b = NodeId("node-a"), NodeId("node-b")
    holdings = {
        a: [(key(i), Tier.DRAM if i % 3 else Tier.SSD) for i in range(0, 600)],
        b: [(key(i), Tier.SSD) for i in range(400, 1000)],
    }
    cluster = meta_cluster(3)
    cluster.start_all()
    cluster.leader_index()
    with cluster.client() as client:
        for node, held in holdings.items():
            client.record_batch(node, held, [], now=1.0)
        assert client.view().num_blocks() == 1000

    for i in range(3):
        cluster.kill(i)
    shutil.rmtree(cluster.data_dir)  # every journal lost

    cluster.start_all()
    cluster.leader_index()
    with cluster.client() as client:
        assert client.view().num_blocks() == 0
        for node, held in holdings.items():  # each node re-adopts what it holds
            client.replace_holdings(node, held, now=2.0)
        expected: dict[bytes, dict[NodeId, Tier]] = {}
        for node, held in holdings.items():
            for k, tier in held:
                expected.setdefault(k, {})[node] = tier
        all_keys = sorted(expected)
        for i in range(3):
            with cluster.client([i]) as one:
                view = one.view()
                wait_until(lambda v=view: v.num_blocks() == 1000, DEADLINE_S, "rebuilt")
                assert view.holders(all_keys) == [expected[k] for k in all_keys]
                assert view.keys_on(a) == sorted(k for k, _ in holdings[a])
