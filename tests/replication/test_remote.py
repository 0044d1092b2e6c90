"""RemoteMetadata and the service in one process (a single-replica group behind a real gRPC
server on loopback): the wire format, argument checks, the holders cache and its staleness,
error mapping, failover over dead addresses, and the journal guard."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.replication import (
    MetadataGroup,
    MetadataUnavailableError,
    NodeId,
    RemoteMetadata,
    ReplicationError,
    Tier,
)
from kvflow.replication.journal_guard import claim_journal_dir
from kvflow.replication.service import create_meta_server
from kvflow.replication.wire import (
    holders_from,
    holders_msg,
    keys_from,
    keys_msg,
    pb2,
    pb2_grpc,
)
from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_channel
from kvflow.tools import meta
from tests.conftest import pick_free_port
from tests.replication.conftest import GroupFactory, make_config
from tests.replication.helpers import blocks, key

A = NodeId("node-a")
B = NodeId("node-b")


@pytest.fixture
def served(open_group: GroupFactory) -> Iterator[tuple[MetadataGroup, str]]:
    """A started single replica and its gRPC service; both stopped at teardown."""
    group = open_group(make_config(f"127.0.0.1:{pick_free_port()}"))
    group.wait_ready(10)
    server, port = create_meta_server(group, "127.0.0.1", 0)
    server.start()
    yield group, f"127.0.0.1:{port}"
    server.stop(grace=None).wait()


def test_wire_round_trips_keys_and_holders() -> None:
    fixed = [key(i) for i in range(5)]
    mixed = [b"a", b"bcd", b"\x00" * 1024]
    assert keys_from(keys_msg(fixed), "k") == fixed
    assert keys_from(keys_msg(mixed), "k") == mixed
    assert keys_from(keys_msg([]), "k") == []
    holders = [{A: Tier.DRAM, B: Tier.SSD}, {}, {B: Tier.DRAM}]
    assert holders_from(holders_msg(holders)) == holders
    with pytest.raises(ValueError, match="truncated"):
        keys_from(pb2.Keys(width=0, blob=b"\x05\x00ab"), "k")
    with pytest.raises(ValueError, match="k\\[0\\]"):
        keys_from(pb2.Keys(width=0, blob=b"\x00\x00"), "k")  # an empty key


def test_remote_writes_and_reads_match_the_group(served: tuple[MetadataGroup, str]) -> None:
    group, address = served
    with RemoteMetadata([address]) as remote:
        remote.wait_ready(5)
        remote.register_node(A, "h:1", "decode", now=1.0)
        remote.record_batch(A, blocks(0, 10), [], now=2.0)
        remote.record_batch(A, [], [key(3)], now=3.0)
        remote.replace_holdings(B, blocks(5, 8, Tier.SSD), now=4.0)
        remote.record_batch(B, [], [], now=5.0)  # empty: nothing sent
        assert group.view().commands_applied() == 4
        local, view = group.view(), remote.view()
        keys = [key(i) for i in range(12)]
        assert view.holders(keys) == local.holders(keys)
        assert view.replicas(key(5)) == {A: Tier.DRAM, B: Tier.SSD}
        assert view.tier_of(key(6), B) is Tier.SSD
        assert view.keys_on(A) == local.keys_on(A)
        assert view.nodes() == local.nodes()
        assert view.node_info(B) == local.node_info(B)
        assert view.node_info(NodeId("nobody")) is None
        assert view.num_blocks() == local.num_blocks() == 9
        assert remote.reap_dead_nodes(now=100.0) == [A, B]  # server's node_dead_after_s: 10
        assert view.num_blocks() == 0
        # without `now`, the serving replica's clock is used (a real wall clock)
        assert remote.heartbeat(A) is False
        info = view.node_info(A)
        assert info is not None and info.last_heartbeat > 1e9


def test_holders_cache_is_stale_for_at_most_its_ttl(served: tuple[MetadataGroup, str]) -> None:
    _, address = served
    with (
        RemoteMetadata([address], cache_ttl_s=60.0) as cached,
        RemoteMetadata([address], cache_ttl_s=0.0) as fresh,
    ):
        cached.record_batch(A, blocks(0, 2), [], now=1.0)
        assert cached.view().replica_counts([key(0), key(1)]) == [1, 1]
        # another client's write: the cached view serves its copy until the TTL or a forget
        fresh.record_batch(B, blocks(0, 1), [], now=2.0)
        assert fresh.view().replica_count(key(0)) == 2
        assert cached.view().replica_count(key(0)) == 1
        cached.view().forget_all()
        assert cached.view().replica_count(key(0)) == 2
        # the client's own writes drop the keys they touch
        cached.record_batch(A, [], [key(0)], now=3.0)
        assert cached.view().replicas(key(0)) == {B: Tier.DRAM}
        assert cached.view().replicas(key(1)) == {A: Tier.DRAM}


def test_bad_arguments_raise_before_sending() -> None:
    with pytest.raises(ValueError, match="addresses"):
        RemoteMetadata([])
    with pytest.raises(ValueError, match="addresses"):
        RemoteMetadata(["nohost"])
    with pytest.raises(ValueError, match="timeout_s"):
        RemoteMetadata(["127.0.0.1:1"], timeout_s=0)
    with pytest.raises(ValueError, match="cache_ttl_s"):
        RemoteMetadata(["127.0.0.1:1"], cache_ttl_s=-1)
    remote = RemoteMetadata(["127.0.0.1:1"], timeout_s=0.2)
    with pytest.raises(ValueError, match="node"):
        remote.record_batch(NodeId(""), blocks(0, 1), [])
    with pytest.raises(TypeError, match="tier"):
        remote.record_batch(A, [(key(0), 0)], [])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="replica target"):
        remote.set_replica_target(key(0), 0)
    with pytest.raises(ValueError, match="now"):
        remote.heartbeat(A, now=float("nan"))
    remote.close()


def test_no_replica_answering_names_every_address() -> None:
    dead = [f"127.0.0.1:{pick_free_port()}" for _ in range(2)]
    remote = RemoteMetadata(dead, timeout_s=0.5, attempt_timeout_s=0.2)
    with pytest.raises(MetadataUnavailableError) as info:
        remote.heartbeat(A, now=1.0)
    assert all(address in str(info.value) for address in dead)
    remote.close()
    remote.close()
    with pytest.raises(MetadataUnavailableError, match="closed"):
        remote.heartbeat(A, now=1.0)


def test_fails_over_from_a_dead_address_to_a_live_one(served: tuple[MetadataGroup, str]) -> None:
    _, address = served
    dead = f"127.0.0.1:{pick_free_port()}"
    with RemoteMetadata([dead, address], timeout_s=5.0) as remote:
        remote.record_batch(A, blocks(0, 3), [], now=1.0)
        assert remote.view().blocks_on(A) == 3


def test_a_closed_replica_is_unavailable(open_group: GroupFactory) -> None:
    group = open_group(make_config(f"127.0.0.1:{pick_free_port()}"))
    group.wait_ready(10)
    server, port = create_meta_server(group, "127.0.0.1", 0)
    server.start()
    try:
        group.close()
        remote = RemoteMetadata([f"127.0.0.1:{port}"], timeout_s=0.3, attempt_timeout_s=0.1)
        with pytest.raises(MetadataUnavailableError, match="closed"):
            remote.heartbeat(A, now=1.0)
        with pytest.raises(MetadataUnavailableError):
            remote.view().num_blocks()
        remote.close()
    finally:
        server.stop(grace=None).wait()


def test_journal_guard_refuses_a_second_process_and_a_new_identity(tmp_path: Path) -> None:
    journal = tmp_path / "meta-0"
    claim = claim_journal_dir(journal, "127.0.0.1:7000", ("127.0.0.1:7001",))
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from kvflow.replication.journal_guard import claim_journal_dir;"
            "claim_journal_dir(pathlib.Path(sys.argv[1]), '127.0.0.1:7000', ('127.0.0.1:7001',))",
            str(journal),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert other.returncode != 0
    assert f"in use by process {os.getpid()}" in other.stderr
    claim.release()
    claim.release()
    with pytest.raises(ReplicationError, match=re.escape("belongs to replica 127.0.0.1:7000")):
        claim_journal_dir(journal, "127.0.0.1:7002", ("127.0.0.1:7001",))
    with pytest.raises(ReplicationError, match="belongs to"):
        claim_journal_dir(journal, "127.0.0.1:7000", ("127.0.0.1:7003",))
    claim_journal_dir(journal, "127.0.0.1:7000", ("127.0.0.1:7001",)).release()


def test_meta_tool_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, default=Path("x"))  # as `kvflow serve` has
    meta.add_meta_arguments(parser)
    assert meta.run_meta(parser.parse_args([])) == 2
    assert "--address" in capsys.readouterr().err
    # (a replica may list itself in --peers: every replica of a StatefulSet gets one list)
    args = parser.parse_args(["--address", "127.0.0.1:1", "--grpc-port", "70000"])
    assert meta.run_meta(args) == 2
    assert "--grpc-port" in capsys.readouterr().err


def test_status_reports_this_replica(served: tuple[MetadataGroup, str]) -> None:
    _, address = served
    with cluster_channel(address, process_secret()) as channel:
        stub = pb2_grpc.MetadataServiceStub(channel)
        status = stub.Status(pb2.StatusRequest(), timeout=5)
        assert status.is_leader and status.ready and status.leader == status.raft_address
        assert status.grpc_address == address
