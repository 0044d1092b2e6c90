"""Three real replica processes (python -m kvflow.tools.meta) on 127.0.0.1, started once for
this module: a leader is elected, writes go through RemoteMetadata (also via a follower
alone), every replica serves the same reads, and kvdb's open_store runs on the remote group."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from kvflow.kvdb import open_store
from kvflow.kvdb.replicas import MetadataReplicas
from kvflow.replication import NodeId, Tier
from kvflow.replication.wire import pb2, pb2_grpc
from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_channel
from tests.kvdb.conftest import NAMESPACE, NBYTES, config, keys
from tests.replication.helpers import blocks, key, wait_until
from tests.replication.procs import MetaCluster

A = NodeId("node-a")
B = NodeId("node-b")
DEADLINE_S = 20.0


def test_three_processes_elect_a_leader_and_serve_writes_and_reads(
    running_cluster: MetaCluster,
) -> None:
    cluster = running_cluster
    leader = cluster.leader_index()
    follower = next(i for i in range(3) if i != leader)
    with cluster.client() as client:
        client.wait_ready(DEADLINE_S)
        client.register_node(A, "127.0.0.1:9000", "prefill", now=1.0)
        client.record_batch(A, blocks(0, 1000, Tier.SSD), [], now=2.0)
        client.set_replica_target(key(5), 2, now=3.0)
        assert client.heartbeat(A, now=4.0) is True
        assert client.leader() == cluster.replicas[leader].raft
    # a follower alone takes writes: pysyncobj forwards them to the leader
    with cluster.client([follower]) as via_follower:
        via_follower.record_batch(B, blocks(1000, 1100), [key(1000)], now=5.0)
        assert via_follower.heartbeat(NodeId("node-new"), now=6.0) is False

    for i in range(3):
        with cluster.client([i]) as one:
            view = one.view()
            wait_until(lambda v=view: v.blocks_on(B) == 99, DEADLINE_S, f"replica {i} applied")
            assert view.holders([key(0), key(999), key(1000), key(1050)]) == [
                {A: Tier.SSD},
                {A: Tier.SSD},
                {},
                {B: Tier.DRAM},
            ]
            assert view.replica_counts([key(1), key(1000)]) == [1, 0]
            assert view.replica_target(key(5)) == 2
            assert view.replica_target(key(6)) == 1
            assert [n.node for n in view.nodes()] == [A, B, "node-new"]
            assert view.nodes()[0].address == "127.0.0.1:9000"
            assert view.nodes()[0].kind == "prefill"
            assert view.num_blocks() == 1099
            assert view.blocks_on(A) == 1000
            assert view.keys_on(B) == [key(j) for j in range(1001, 1100)]
            assert view.leader() == cluster.replicas[leader].raft
            assert view.is_leader() == (i == leader)


def test_bad_input_is_invalid_argument_and_writes_nothing(running_cluster: MetaCluster) -> None:
    address = running_cluster.replicas[0].grpc
    with cluster_channel(address, process_secret()) as channel:
        stub = pb2_grpc.MetadataServiceStub(channel)
        before = stub.Status(pb2.StatusRequest(), timeout=5).commands_applied
        bad = [
            pb2.RecordBatchRequest(
                node="n", stored=pb2.Keys(width=16, blob=b"x" * 17), stored_tiers=b"\0"
            ),
            pb2.RecordBatchRequest(
                node="n", stored=pb2.Keys(width=4, blob=b"abcd"), stored_tiers=b"\x07"
            ),
            pb2.RecordBatchRequest(node="n", stored=pb2.Keys(width=4, blob=b"abcd")),
            pb2.RecordBatchRequest(node="", stored=pb2.Keys(width=4, blob=b"abcd"), now=1.0),
        ]
        for request in bad:
            with pytest.raises(grpc.RpcError) as info:
                stub.RecordBatch(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            stub.SetReplicaTarget(pb2.SetReplicaTargetRequest(key=b"k", target=0), timeout=5)
        assert "replica target" in (info.value.details() or "")
        assert stub.Status(pb2.StatusRequest(), timeout=5).commands_applied == before
    with running_cluster.client([0]) as client, pytest.raises(ValueError, match="stored"):
        client.record_batch(A, [(b"", Tier.DRAM)], [])


def test_kvdb_store_runs_on_the_remote_group(running_cluster: MetaCluster, tmp_path: Path) -> None:
    node = NodeId("kvdb-node")
    block_keys = keys(6)
    with running_cluster.client() as remote:
        store = open_store(config(tmp_path), NAMESPACE, node_id=node, metadata=remote)
        try:
            client = store.client()
            for i, k in enumerate(block_keys):
                client.put(k, np.full(NBYTES, i, dtype=np.uint8))
            store.flush_metadata()
            view = remote.view()
            assert sorted(view.keys_on(node)) == sorted(block_keys)
            counts = MetadataReplicas(view, node).replica_counts(block_keys)  # type: ignore[arg-type]
            assert counts == [1] * 6
            client.change_replica(block_keys[0], 2)
            assert view.replica_target(block_keys[0]) == 2
        finally:
            store.close()
