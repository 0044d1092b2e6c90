"""A KVAdmin with no shards of its own (a router's) answering Hot, Replicas and Stats by asking
two real KVAdmin gRPC servers (127.0.0.1, each one shard holding blocks of two tenants) and a
port nobody listens on: the caller's tenant goes down as the filter, the answers are merged,
the dead peer is named in ``skipped_nodes``."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvflow.kvdb import (
    AdminPeer,
    AdminPeers,
    KVAdmin,
    NodeId,
    Shard,
    ShardRef,
    StaticAdminSource,
    UnknownShardError,
    Viewer,
    add_admin_service,
)
from kvflow.kvdb.proto import pb2
from tests.conftest import pick_free_port
from tests.kvdb.conftest import NAMESPACE, config, keys, value

ALICE, BOB = Viewer("tenant-a"), Viewer("tenant-b")


class Node:
    """A started sync grpc server with KVAdmin over one memory shard named after the node."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.name = name
        self.shard = Shard(config(tmp_path / name), NAMESPACE.fingerprint(), node_id=NodeId(name))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        add_admin_service(
            self.server, StaticAdminSource({name: ShardRef(self.shard, NodeId(name), "prefill")})
        )
        port = pick_free_port()
        self.address = f"127.0.0.1:{port}"
        assert self.server.add_insecure_port(self.address) == port
        self.server.start()

    def store(self, tenant: str, n: int, reads: int) -> list[bytes]:
        """``n`` blocks of ``tenant``, each read ``reads`` times; their keys."""
        ks = keys(n, tenant)
        for i, key in enumerate(ks):
            self.shard.put(key, value(i), parent=ks[i - 1] if i else None, tenant=tenant)
            for _ in range(reads):
                assert self.shard.get(key) is not None
        return ks

    def close(self) -> None:
        self.server.stop(None).wait()
        self.shard.close()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    a, b = Node(tmp_path, "node-a"), Node(tmp_path, "node-b")
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def router(nodes: tuple[Node, Node]) -> Iterator[KVAdmin]:
    peers = [AdminPeer(n.name, n.address) for n in nodes]
    peers.append(AdminPeer("node-dead", f"127.0.0.1:{pick_free_port()}"))
    fanout = AdminPeers(lambda: peers, timeout_s=2.0, channel_of=grpc.insecure_channel)
    yield KVAdmin(StaticAdminSource({}, peers=fanout))
    fanout.close()


def test_hot_is_the_callers_blocks_of_every_node_merged_by_hits(nodes, router) -> None:
    a, b = nodes
    a_alice = a.store("tenant-a", 2, reads=1)
    b_alice = b.store("tenant-a", 1, reads=3)
    a.store("tenant-b", 3, reads=5)
    mine = router.Hot(pb2.HotRequest(n=100), ALICE)
    rows = [(bytes.fromhex(r.key), r.hits, r.node) for r in mine.blocks]
    assert rows[0] == (b_alice[0], 3, "node-b")  # the most read first, whichever node
    assert set(rows[1:]) == {(a_alice[0], 1, "node-a"), (a_alice[1], 1, "node-a")}
    assert list(mine.skipped_nodes) == ["node-dead"]
    assert len(router.Hot(pb2.HotRequest(n=1), ALICE).blocks) == 1  # the top n of the merge
    every = router.Hot(pb2.HotRequest(n=100), Viewer())
    assert {r.tenant for r in every.blocks} == {"tenant-a", "tenant-b"}
    only_b = router.Hot(pb2.HotRequest(n=100, tenant="tenant-b"), Viewer())
    assert [r.hits for r in only_b.blocks] == [5, 5, 5]
    assert [r.node for r in router.Hot(pb2.HotRequest(n=100, shard="node-b"), Viewer()).blocks] == [
        "node-b"
    ]
    with pytest.raises(UnknownShardError, match="node-dead did not answer"):
        router.Hot(pb2.HotRequest(n=10, shard="nowhere"), Viewer())


def test_replicas_union_the_owners_rows_and_hide_other_tenants_keys(nodes, router) -> None:
    a, b = nodes
    shared = a.store("tenant-a", 1, reads=0)[0]
    assert b.store("tenant-a", 1, reads=0)[0] == shared  # the same block on both nodes
    bobs = a.store("tenant-b", 1, reads=0)[0]

    def replicas(key: bytes, viewer: Viewer, tenant: str = "") -> Any:
        return router.Replicas(pb2.ReplicasRequest(key=key.hex(), tenant=tenant), viewer)

    own = replicas(shared, ALICE)
    assert [(r.node, r.source) for r in own.replicas] == [("node-a", "local"), ("node-b", "local")]
    assert list(own.skipped_nodes) == ["node-dead"]
    probe, unknown = replicas(bobs, ALICE), replicas(bytes(range(16)), ALICE)
    assert not probe.replicas
    probe.key = unknown.key
    assert probe == unknown  # bob's block is not even confirmed to exist
    assert [r.node for r in replicas(bobs, Viewer()).replicas] == ["node-a"]
    assert not replicas(bobs, Viewer(), tenant="tenant-a").replicas  # an admin's filter
    assert replicas(bobs, BOB).replicas


def test_stats_give_a_user_its_holdings_per_node_and_an_admin_the_sums(nodes, router) -> None:
    a, b = nodes
    a.store("tenant-a", 2, reads=1)
    b.store("tenant-b", 3, reads=1)
    mine = router.Stats(pb2.StatsRequest(), ALICE)
    assert not mine.shards and mine.total.puts == 0  # the peers' shard-wide rows are dropped
    assert [(t.node, t.tenant, t.blocks) for t in mine.tenants] == [
        ("node-a", "tenant-a", 2),
        ("node-b", "tenant-a", 0),
    ]
    assert list(mine.skipped_nodes) == ["node-dead"]
    every = router.Stats(pb2.StatsRequest(), Viewer())
    assert [(s.node, s.puts) for s in every.shards] == [("node-a", 2), ("node-b", 3)]
    assert (every.total.puts, every.total.hits, every.total.hit_rate) == (5, 5, 1.0)
