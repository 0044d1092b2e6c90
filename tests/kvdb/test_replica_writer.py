"""Durable puts at the kvdb level: the BlockService ``Store`` RPC that takes a pushed copy, and
``EmbeddedClient.put(..., replicas=N)`` through a ``ReplicaWriter`` between two real nodes
(two stores in one metadata group, each with a gRPC BlockService)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvflow.kvdb import (
    BlockToCopy,
    NotEnoughReplicasError,
    ReplicaWriter,
    ShardRef,
    StaticAdminSource,
    Store,
    add_block_service,
    open_store,
)
from kvflow.kvdb.codec import block_checksum
from kvflow.kvdb.proto import pb2, pb2_grpc
from kvflow.replication import MetadataConfig, MetadataGroup, NodeId
from kvflow.transfer import TransferConfig, TransferEngine
from tests.conftest import pick_free_port
from tests.kvdb.conftest import NAMESPACE, config, keys, value


class Node:
    """A store in ``group`` serving its BlockService on 127.0.0.1, registered as ``kind``."""

    def __init__(self, tmp_path: Path, name: str, group: MetadataGroup, record: bool = True):
        self.name = NodeId(name)
        self.store: Store = open_store(
            config(tmp_path, data_dir=tmp_path / name), NAMESPACE, node_id=self.name, metadata=group
        )
        self.transfer = TransferEngine(TransferConfig(prefer_shm=False))
        self.transfer.start_server()
        source = StaticAdminSource({name: ShardRef(self.store.shard, self.name, "prefill")})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        flush = self.store.flush_metadata if record else None
        self.blocks = add_block_service(self.server, source, self.transfer, record=flush)
        port = pick_free_port()
        self.address = f"127.0.0.1:{port}"
        assert self.server.add_insecure_port(self.address) == port
        self.server.start()
        group.register_node(
            self.name, f"{self.address}|{self.transfer.peer_address}", "prefill", time.time()
        )
        self.writer = ReplicaWriter(
            self.name,
            group,
            self.store.flush_metadata,
            kinds=frozenset({"prefill"}),
            dead_after_s=5.0,
        )
        self.store.replica_writer = self.writer

    def close(self) -> None:
        self.writer.close()
        self.server.stop(None).wait()
        self.blocks.close()
        self.transfer.close()
        self.store.close()


@pytest.fixture
def group() -> Iterator[MetadataGroup]:
    g = MetadataGroup(MetadataConfig(self_address=f"127.0.0.1:{pick_free_port()}"))
    g.start()
    g.wait_ready(10.0)
    yield g
    g.close()


def test_put_with_two_replicas_is_held_and_recorded_by_two_nodes_before_it_returns(
    tmp_path: Path, group: MetadataGroup
) -> None:
    a, b = Node(tmp_path, "a", group), Node(tmp_path, "b", group)
    try:
        key, parent = keys(2)
        client = a.store.client()
        assert client.put(key, value(1), None, replicas=2) is not None
        # no waiting: both copies are in the metadata and in b's shard when put returns
        assert set(group.view().replicas(key)) == {"a", "b"}
        assert group.view().replica_target(key) == 2
        assert (b.store.shard.get(key) or b"") == value(1).tobytes()
        info = b.store.shard.info(key)
        assert info is not None and info.tenant == NAMESPACE.tenant
        # three replicas with two nodes: refused, saying how many are live
        with pytest.raises(NotEnoughReplicasError, match="replicas=3 needs 2 live peer"):
            client.put(parent, value(2), key, replicas=3)
        assert not a.store.shard.exists(parent)  # not acknowledged: the writer's copy is gone
    finally:
        a.close()
        b.close()


def test_a_single_node_store_refuses_replicas_above_one(tmp_path: Path) -> None:
    store = open_store(config(tmp_path), NAMESPACE)
    try:
        with pytest.raises(NotEnoughReplicasError, match="no peers"):
            store.client().put(keys(1)[0], value(0), replicas=2)
    finally:
        store.close()


def test_store_rpc_checks_checksums_and_needs_a_metadata_to_record_in(
    tmp_path: Path, group: MetadataGroup
) -> None:
    a, mute = Node(tmp_path, "a", group), Node(tmp_path, "m", group, record=False)
    channel = grpc.insecure_channel(a.address)
    mute_channel = grpc.insecure_channel(mute.address)
    try:
        (key,) = keys(1)
        data = value(3).tobytes()
        good = pb2.StoredBlock(
            key=key, value=data, tenant="t", checksum=block_checksum(key, None, "t", data)
        )
        bad = pb2.StoredBlock(key=key, value=data[:-1] + b"\0", tenant="t", checksum=good.checksum)
        stub = pb2_grpc.BlockServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Store(pb2.StoreRequest(blocks=[bad]), timeout=10)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "fails its checksum" in (refused.value.details() or "")
        assert not a.store.shard.exists(key)
        assert list(stub.Store(pb2.StoreRequest(blocks=[good]), timeout=10).held) == [True]
        assert NodeId("a") in group.view().replicas(key)  # recorded before the answer
        with pytest.raises(grpc.RpcError) as no_meta:
            pb2_grpc.BlockServiceStub(mute_channel).Store(
                pb2.StoreRequest(blocks=[good]), timeout=10
            )
        assert no_meta.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        # a writer whose only candidate (m) refuses fails instead of acknowledging
        block = BlockToCopy(keys(2)[1], value(4), None, "t")
        assert a.store.shard.put(block.key, block.value, None, "t") is not None
        with pytest.raises(NotEnoughReplicasError, match="only 1 node"):
            a.writer.write([block], 2, held_locally=True)
        assert a.writer.push_failures == 1
    finally:
        channel.close()
        mute_channel.close()
        a.close()
        mute.close()
