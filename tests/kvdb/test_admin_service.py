"""The KVAdmin gRPC service on a real grpc server (127.0.0.1, free port) over real rocksdb
shards: every RPC, every bad-input case, and the sync and asyncio server flavours."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvflow.kvdb import (
    ADMIN_SERVICE_NAME,
    NodeId,
    Shard,
    ShardRef,
    StaticAdminSource,
    Tier,
    add_admin_service,
)
from kvflow.kvdb.proto import pb2, pb2_grpc
from kvflow.replication import MetadataTable, MetadataView
from tests.kvdb.conftest import NAMESPACE, NBYTES, RECORD, config, keys, value

NOW = 1_000_000.0


class Admin:
    """A started sync grpc server with KVAdmin over two rocksdb shards, and a stub."""

    def __init__(self, tmp_path: Path, port: int, metadata: Any = None) -> None:
        self.shards = {
            sid: Shard(
                config(tmp_path, data_dir=tmp_path / sid, engine="rocksdb"),
                NAMESPACE.fingerprint(),
                node_id=NodeId(node),
                shuffle_bytes=2,
            )
            for sid, node in (("s0", "node-a"), ("s1", "node-b"))
        }
        source = StaticAdminSource(
            {
                "s0": ShardRef(self.shards["s0"], NodeId("node-a"), "prefill", "10.0.0.1:7000"),
                "s1": (self.shards["s1"], NodeId("node-b"), "decode"),  # a plain tuple works
            },
            metadata,
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        add_admin_service(self.server, source, clock=lambda: NOW)
        self.address = f"127.0.0.1:{port}"
        assert self.server.add_insecure_port(self.address) == port
        self.server.start()
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb2_grpc.KVAdminStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None).wait()
        for shard in self.shards.values():
            shard.close()


@pytest.fixture
def admin(tmp_path: Path, free_port: int) -> Iterator[Admin]:
    a = Admin(tmp_path, free_port)
    yield a
    a.close()


@pytest.fixture
def table() -> MetadataTable:
    t = MetadataTable()
    t.register_node(NodeId("node-a"), "10.0.0.1:7000", "prefill", NOW - 1)
    t.register_node(NodeId("node-b"), "10.0.0.2:7000", "decode", NOW - 60)  # silent for 60 s
    return t


def fill(shard: Shard, n: int) -> list[bytes]:
    ks = keys(n)
    for i, k in enumerate(ks):
        assert shard.put(k, value(i), parent=ks[i - 1] if i else None) is Tier.DRAM
    return ks


def read(shard: Shard, key: bytes, times: int) -> None:
    buf = bytearray(NBYTES)
    for _ in range(times):
        assert shard.get_into(key, buf) is not None


def expect_error(call: Any, request: Any, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=5)
    assert info.value.code() is code
    for word in words:
        assert word in info.value.details()


# ----------------------------------------------------------------------------- RPCs


def test_service_name_constant() -> None:
    assert ADMIN_SERVICE_NAME == "kvflow.kvdb.v1.KVAdmin"


def test_nodes_without_metadata_lists_local_shards(admin: Admin) -> None:
    fill(admin.shards["s0"], 3)
    reply = admin.stub.Nodes(pb2.NodesRequest(), timeout=5)
    rows = [
        (n.node, n.kind, n.address, n.healthy, n.blocks, n.source, n.shard) for n in reply.nodes
    ]
    assert rows == [
        ("node-a", "prefill", "10.0.0.1:7000", True, 3, "local", "s0"),
        ("node-b", "decode", "", True, 0, "local", "s1"),
    ]
    assert reply.total_blocks == 3
    assert not reply.nodes[0].has_heartbeat


def test_nodes_from_metadata_with_health(tmp_path: Path, free_port: int, table: Any) -> None:
    table.record_batch(NodeId("node-a"), [(keys(2)[0], Tier.DRAM), (keys(2)[1], Tier.SSD)], [], NOW)
    a = Admin(tmp_path, free_port, MetadataView.of_table(table))
    try:
        reply = a.stub.Nodes(pb2.NodesRequest(), timeout=5)
    finally:
        a.close()
    by = {n.node: n for n in reply.nodes}
    assert set(by) == {"node-a", "node-b"}
    assert by["node-a"].healthy and by["node-a"].blocks == 2 and by["node-a"].heartbeat_age_s == 0
    assert by["node-a"].address == "10.0.0.1:7000" and by["node-a"].kind == "prefill"
    assert not by["node-b"].healthy and by["node-b"].heartbeat_age_s == pytest.approx(60)
    assert by["node-b"].source == "metadata" and by["node-b"].has_heartbeat
    assert reply.total_blocks == 2


def test_shards_usage_and_engine(admin: Admin) -> None:
    s0 = admin.shards["s0"]
    ks = fill(s0, 3)
    s0.pin(ks[:1])
    reply = admin.stub.Shards(pb2.ShardsRequest(), timeout=5)
    assert [s.shard for s in reply.shards] == ["s0", "s1"]
    row = reply.shards[0]
    stats = s0.stats()
    assert (row.node, row.kind, row.engine, row.eviction) == (
        "node-a",
        "prefill",
        "rocksdb",
        "prefix_replica_lru",
    )
    assert row.dram.blocks == 3 and row.dram.used_bytes == stats.dram.used_bytes
    assert row.dram.capacity_bytes == 8 * NBYTES and row.ssd.capacity_bytes == 16 * RECORD
    assert row.pinned_blocks == 1 and not row.closed
    s0.unpin(ks[:1])


def test_tiers_counters_after_reads_and_demotion(admin: Admin) -> None:
    s0 = admin.shards["s0"]
    ks = fill(s0, 4)
    read(s0, ks[0], 2)
    assert s0.get(keys(9)[8]) is None  # a miss
    s0.evict(Tier.DRAM, NBYTES)  # the leaf (ks[3]) goes to SSD
    read(s0, ks[3], 1)  # an SSD hit (promoted again)
    reply = admin.stub.Tiers(pb2.TiersRequest(shard="s0"), timeout=5)
    dram, ssd = reply.tiers
    assert (dram.shard, dram.tier, ssd.tier) == ("s0", "dram", "ssd")
    assert dram.hits == 2 and dram.misses == 2 and dram.demotions == 1
    assert dram.hit_rate == pytest.approx(0.5)
    assert ssd.hits == 1 and ssd.misses == 1 and ssd.promotions == 1 and ssd.blocks == 1
    assert dram.bytes_read == 2 * NBYTES and dram.bytes_written == 4 * NBYTES
    everything = admin.stub.Tiers(pb2.TiersRequest(), timeout=5)
    assert [(t.shard, t.tier) for t in everything.tiers] == [
        ("s0", "dram"),
        ("s0", "ssd"),
        ("s1", "dram"),
        ("s1", "ssd"),
    ]


def test_replicas_from_local_shards(admin: Admin) -> None:
    ks = fill(admin.shards["s0"], 2)
    admin.shards["s1"].put(ks[0], value(0))
    admin.shards["s1"].evict(Tier.DRAM, NBYTES)
    reply = admin.stub.Replicas(pb2.ReplicasRequest(key=ks[0].hex().upper()), timeout=5)
    assert reply.key == ks[0].hex() and not reply.has_metadata and reply.replica_target == 0
    assert [(r.node, r.tier, r.source, r.shard) for r in reply.replicas] == [
        ("node-a", "dram", "local", "s0"),
        ("node-b", "ssd", "local", "s1"),
    ]
    absent = admin.stub.Replicas(pb2.ReplicasRequest(key="00" * 16), timeout=5)
    assert list(absent.replicas) == []


def test_replicas_from_metadata(tmp_path: Path, free_port: int, table: Any) -> None:
    k = keys(1)[0]
    table.record_batch(NodeId("node-a"), [(k, Tier.DRAM)], [], NOW)
    table.record_batch(NodeId("node-c"), [(k, Tier.SSD)], [], NOW)
    table.set_replica_target(k, 3, NOW)
    a = Admin(tmp_path, free_port, MetadataView.of_table(table))
    try:
        a.shards["s0"].put(k, value(0))
        reply = a.stub.Replicas(pb2.ReplicasRequest(key=k.hex()), timeout=5)
    finally:
        a.close()
    assert reply.has_metadata and reply.replica_target == 3
    assert [(r.node, r.tier, r.source) for r in reply.replicas] == [
        ("node-a", "dram", "metadata"),
        ("node-c", "ssd", "metadata"),
        ("node-a", "dram", "local"),
    ]


def test_hot_orders_by_hits_across_shards(admin: Admin) -> None:
    ks = fill(admin.shards["s0"], 4)
    admin.shards["s1"].put(ks[3], value(3))
    read(admin.shards["s0"], ks[2], 5)
    read(admin.shards["s0"], ks[0], 2)
    read(admin.shards["s1"], ks[3], 3)
    reply = admin.stub.Hot(pb2.HotRequest(n=2), timeout=5)
    assert [(b.key, b.hits, b.shard, b.node, b.tier) for b in reply.blocks] == [
        (ks[2].hex(), 5, "s0", "node-a", "dram"),
        (ks[3].hex(), 3, "s1", "node-b", "dram"),
    ]
    assert reply.blocks[0].nbytes == NBYTES
    only = admin.stub.Hot(pb2.HotRequest(n=10, shard="s0"), timeout=5)
    assert [(b.key, b.hits) for b in only.blocks] == [(ks[2].hex(), 5), (ks[0].hex(), 2)]


def test_stats_counts_and_reset(admin: Admin) -> None:
    s0 = admin.shards["s0"]
    ks = fill(s0, 3)
    s0.put(ks[0], value(0))  # already held: counted as a put, no write
    read(s0, ks[1], 2)
    assert s0.get(keys(9)[8]) is None
    reply = admin.stub.Stats(pb2.StatsRequest(reset=True), timeout=5)
    row = reply.shards[0]
    assert (row.shard, row.puts, row.gets, row.hits, row.dram_hits, row.misses) == (
        "s0",
        4,
        3,
        2,
        2,
        1,
    )
    assert row.hit_rate == pytest.approx(2 / 3)
    assert row.bytes_read == 2 * NBYTES and row.bytes_written == 3 * NBYTES
    assert reply.total.shard == "total" and reply.total.puts == 4 and reply.total.gets == 3
    after = admin.stub.Stats(pb2.StatsRequest(shard="s0"), timeout=5)
    assert after.shards[0].puts == 0 and after.shards[0].gets == 0 and len(after.shards) == 1


def test_evict_dram_demotes_and_reports_usage(admin: Admin) -> None:
    s0 = admin.shards["s0"]
    ks = fill(s0, 4)
    reply = admin.stub.Evict(pb2.EvictRequest(shard="s0", tier="dram", bytes=2 * NBYTES))
    assert reply.blocks_evicted == 2
    assert (reply.before.blocks, reply.after.blocks) == (4, 2)
    assert reply.after.used_bytes == reply.before.used_bytes - 2 * NBYTES
    assert [s0.tier_of(k) for k in ks] == [Tier.DRAM, Tier.DRAM, Tier.SSD, Tier.SSD]
    ssd = admin.stub.Evict(pb2.EvictRequest(shard="s0", tier="SSD", bytes=1), timeout=5)
    assert ssd.blocks_evicted == 1 and s0.tier_of(ks[3]) is None  # the leaf goes first
    zero = admin.stub.Evict(pb2.EvictRequest(shard="s1", tier="dram", bytes=0), timeout=5)
    assert zero.blocks_evicted == 0


# ----------------------------------------------------------------------------- bad input


def test_unknown_shard_is_not_found(admin: Admin) -> None:
    s = admin.stub
    nf = grpc.StatusCode.NOT_FOUND
    expect_error(s.Tiers, pb2.TiersRequest(shard="nope"), nf, "'nope'", "s0", "s1")
    expect_error(s.Hot, pb2.HotRequest(n=1, shard="nope"), nf, "'nope'")
    expect_error(s.Stats, pb2.StatsRequest(shard="nope"), nf, "'nope'")
    expect_error(s.Evict, pb2.EvictRequest(shard="nope", tier="dram", bytes=1), nf, "'nope'")


@pytest.mark.parametrize(
    "key, words",
    [
        ("abc", ["32 hex characters", "3 characters"]),
        ("zz" * 16, ["not hexadecimal"]),
        ("", ["32 hex characters"]),
        ("00" * 17, ["34 characters"]),
    ],
)
def test_malformed_key_is_invalid_argument(admin: Admin, key: str, words: list[str]) -> None:
    expect_error(
        admin.stub.Replicas,
        pb2.ReplicasRequest(key=key),
        grpc.StatusCode.INVALID_ARGUMENT,
        *words,
    )


@pytest.mark.parametrize(
    "request_, words",
    [
        (pb2.EvictRequest(shard="s0", tier="dram", bytes=-1), ["bytes must be >= 0", "-1"]),
        (pb2.EvictRequest(shard="s0", tier="hbm", bytes=1), ["tier must be one of", "'hbm'"]),
        (pb2.EvictRequest(shard="s0", tier="", bytes=1), ["tier must be one of"]),
        (pb2.EvictRequest(tier="dram", bytes=1), ["shard is required"]),
    ],
)
def test_bad_evict_is_invalid_argument(admin: Admin, request_: Any, words: list[str]) -> None:
    ks = fill(admin.shards["s0"], 2)
    expect_error(admin.stub.Evict, request_, grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert [admin.shards["s0"].tier_of(k) for k in ks] == [Tier.DRAM, Tier.DRAM]  # untouched


@pytest.mark.parametrize("n", [0, -3, 10_001])
def test_bad_hot_count_is_invalid_argument(admin: Admin, n: int) -> None:
    expect_error(
        admin.stub.Hot, pb2.HotRequest(n=n), grpc.StatusCode.INVALID_ARGUMENT, "n must be in"
    )


def test_closed_shard_evict_is_unavailable_and_listing_still_works(admin: Admin) -> None:
    admin.shards["s1"].close()
    expect_error(
        admin.stub.Evict,
        pb2.EvictRequest(shard="s1", tier="dram", bytes=1),
        grpc.StatusCode.UNAVAILABLE,
        "closed",
    )
    reply = admin.stub.Shards(pb2.ShardsRequest(), timeout=5)
    assert [s.closed for s in reply.shards] == [False, True]


# ----------------------------------------------------------------------------- asyncio server


def test_asyncio_server(tmp_path: Path, free_port: int) -> None:
    shard = Shard(config(tmp_path, engine="rocksdb"), NAMESPACE.fingerprint(), shuffle_bytes=2)
    ks = fill(shard, 2)
    source = StaticAdminSource({"only": ShardRef(shard, NodeId("local"), "prefill")})

    async def scenario() -> tuple[Any, grpc.StatusCode]:
        server = grpc.aio.server()
        add_admin_service(server, source)
        server.add_insecure_port(f"127.0.0.1:{free_port}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port}") as channel:
                stub = pb2_grpc.KVAdminStub(channel)
                evicted = await stub.Evict(pb2.EvictRequest(shard="only", tier="dram", bytes=1))
                try:
                    await stub.Evict(pb2.EvictRequest(shard="only", tier="dram", bytes=-1))
                except grpc.aio.AioRpcError as exc:
                    return evicted, exc.code()
                raise AssertionError("negative bytes accepted")
        finally:
            await server.stop(None)

    try:
        evicted, code = asyncio.run(scenario())
        assert [shard.tier_of(k) for k in ks] == [Tier.DRAM, Tier.SSD]
    finally:
        shard.close()
    assert evicted.blocks_evicted == 1 and code is grpc.StatusCode.INVALID_ARGUMENT
