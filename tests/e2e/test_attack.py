"""An attacker on the same host, without the cluster secret, against a real cluster on
127.0.0.1 (1 metadata replica, 1 prefill node, 1 decode node, 1 router): it cannot register a
node, lease or read a block, use the transfer port, or get a pickle past the Raft port. Each
attack has a positive control that the same call *with* the secret works. Every one of these
succeeded on the code before the cluster secret."""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
import pytest

from kvflow.kvdb.proto import pb2 as kvdb_pb2
from kvflow.kvdb.proto import pb2_grpc as kvdb_pb2_grpc
from kvflow.replication.wire import pb2 as meta_pb2
from kvflow.replication.wire import pb2_grpc as meta_pb2_grpc
from kvflow.security.grpc_auth import cluster_channel
from kvflow.stages.api import node_pb2, node_pb2_grpc, pb2
from kvflow.stages.api.client import InferenceClient
from kvflow.tools.supervise import LocalCluster
from kvflow.transfer import TransferConfig, TransferEngine

from ..security.pickle_attack import send_pickle

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(one_of_each: LocalCluster) -> LocalCluster:
    return one_of_each


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def node_addresses(cluster: LocalCluster) -> tuple[str, str]:
    """(control, transfer) of prefill-0, read from the metadata with the secret."""
    with cluster_channel(cluster.meta_addresses[0], cluster.secret) as channel:
        reply = meta_pb2_grpc.MetadataServiceStub(channel).Nodes(meta_pb2.NodesRequest(), timeout=5)
    [address] = [n.address for n in reply.nodes if n.node == "prefill-0"]
    control, _, transfer = address.partition("|")
    return control, transfer


def test_no_node_registration_without_the_secret(cluster) -> None:
    request = meta_pb2.RegisterNodeRequest(
        node="evil", address="127.0.0.1:1|127.0.0.1:2", kind="prefill"
    )
    with grpc.insecure_channel(cluster.meta_addresses[0]) as channel:
        stub = meta_pb2_grpc.MetadataServiceStub(channel)
        assert (
            code_of(lambda: stub.RegisterNode(request, timeout=5))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert code_of(lambda: stub.Nodes(meta_pb2.NodesRequest(), timeout=5)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
    with cluster_channel(cluster.meta_addresses[0], cluster.secret) as channel:
        nodes = meta_pb2_grpc.MetadataServiceStub(channel).Nodes(meta_pb2.NodesRequest(), timeout=5)
    assert {n.node for n in nodes.nodes} == {"prefill-0", "decode-0"}


def test_no_lease_no_node_call_without_the_secret(cluster) -> None:
    control, _ = node_addresses(cluster)
    with cluster_channel(cluster.meta_addresses[0], cluster.secret) as channel:
        stub = meta_pb2_grpc.MetadataServiceStub(channel)
        request = meta_pb2.NodeBlocksRequest(node="prefill-0", include_keys=True)
        packed = stub.NodeBlocks(request, timeout=5).keys
    blob, width = packed.blob, packed.width
    assert blob and width, "the fixture's request stored blocks on prefill-0 (wait_recorded)"
    keys = [blob[i : i + width] for i in range(0, len(blob), width)]
    with grpc.insecure_channel(control) as channel:
        blocks = kvdb_pb2_grpc.BlockServiceStub(channel)
        lease = kvdb_pb2.LeaseRequest(keys=keys[:1])
        assert code_of(lambda: blocks.Lease(lease, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        push = kvdb_pb2.StoreRequest(blocks=[kvdb_pb2.StoredBlock(key=keys[0], value=b"x")])
        assert code_of(lambda: blocks.Store(push, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        node = node_pb2_grpc.NodeStub(channel)
        info = node_pb2.InfoRequest()
        assert code_of(lambda: node.Info(info, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    with cluster_channel(control, cluster.secret) as channel:
        reply = kvdb_pb2_grpc.BlockServiceStub(channel).Lease(lease, timeout=5)
        assert len(reply.blocks) == 1  # with the secret the same lease works
        kvdb_pb2_grpc.BlockServiceStub(channel).Release(
            kvdb_pb2.ReleaseRequest(lease_id=reply.lease_id), timeout=5
        )


def test_the_transfer_port_moves_nothing_without_the_secret(cluster) -> None:
    _, transfer = node_addresses(cluster)
    host, _, port = transfer.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"\x00" * 64)  # a request header and more: read as a wrong handshake answer
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
    assert received.startswith(b"KVFH1") and len(received) == 37
    for secret, opens in ((None, False), (cluster.secret.transfer_key(), True)):
        config = TransferConfig(secret=secret, prefer_shm=False, connect_timeout_s=1.0)
        with TransferEngine(config) as engine:
            try:
                engine.open_segment(transfer, "prefill-0/pool")
                opened = True
            except Exception:
                opened = False
        assert opened == opens


def test_a_pickle_never_gets_past_the_raft_port(cluster, tmp_path: Path) -> None:
    raft = cluster.procs["meta-0"].args[cluster.procs["meta-0"].args.index("--address") + 1]
    marker = tmp_path / "pwned"
    send_pickle(raft, marker)
    assert not marker.exists()
    with InferenceClient(cluster.addresses) as client:  # and the cluster still serves
        req = pb2.GenerateRequest(max_tokens=2)
        req.token_ids.ids.extend(range(7, 30))
        assert len([t for m in client.generate(req, timeout=60) for t in m.token_ids]) == 2


@pytest.mark.faults
def test_the_pickle_probe_runs_no_code_on_any_listener(cluster, tmp_path: Path) -> None:
    """Every port any process of the cluster listens on (asked of the kernel), not only the
    Raft port: the frame is sent as a first message and after a hello; no file appears."""
    from ..faults.roles import listening_ports

    ports: set[int] = set()
    for proc in cluster.procs.values():
        assert proc.popen is not None
        ports |= listening_ports(proc.popen.pid)
    assert len(ports) >= 12  # meta, 2 nodes, router: gRPC, metrics, Raft, transfer, HTTP
    for port in sorted(ports):
        send_pickle(f"127.0.0.1:{port}", tmp_path / f"pwned-{port}", wait_s=0.4)
    assert not list(tmp_path.glob("pwned-*"))
    assert all(proc.alive() for proc in cluster.procs.values())
