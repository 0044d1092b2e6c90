"""A router's kvdb views with API keys, on a real cluster (1 metadata replica, 2 prefill nodes,
1 decode node, 1 router with a key file): the router asks every node's KVAdmin (cluster token,
the caller's tenant as the filter) and merges the answers, so a user key sees its own blocks
there and never another tenant's, and an admin sees both. Before, the router read only the
metadata (holders, no owners): a user key saw no blocks at all and an admin no tenants.

The last test kills a node: it is named in ``skipped_nodes`` and the others still answer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvflow.kvdb.proto import pb2 as kvdb_pb2
from kvflow.kvdb.proto import pb2_grpc as kvdb_pb2_grpc
from kvflow.stages.api import pb2, pb2_grpc
from kvflow.tools.cli import main
from kvflow.tools.supervise import LocalCluster
from tests.cluster_member import heal, running_as_member

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ALICE, BOB, ROOT = "alice-key-0123456789", "bob-key-0123456789ab", "root-key-0123456789ab"
ALICE_IDS, BOB_IDS = tuple(range(190, 260)), tuple(range(240, 310))
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("router-views")
    keyfile = data / "keys.txt"
    keyfile.write_text(f"{ALICE} alice user\n{BOB} bob user\n{ROOT} - admin\n")
    c = LocalCluster(
        data / "cluster",
        meta=1,
        prefill=2,
        decode=1,
        model=tiny_model,
        extra=("--block-size", "16", "--num-pages", "128", "--dram-mb", "32"),
        router_extra=("--policy", "round-robin", "--api-key-file", str(keyfile)),
    )
    with running_as_member(c, timeout_s=180):  # stops every process (paused ones too)
        yield c


@pytest.fixture(autouse=True)
def whole(cluster: LocalCluster) -> None:
    heal(cluster)


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.fixture(scope="module")
def channel(cluster: LocalCluster) -> Iterator[grpc.Channel]:
    """A plain channel to the router: the API key, not the cluster token, says who calls."""
    with grpc.insecure_channel(cluster.address) as ch:
        yield ch


def generate(channel: grpc.Channel, key: str, ids: tuple[int, ...]) -> Any:
    req = pb2.GenerateRequest(max_tokens=2)
    req.token_ids.ids.extend(ids)
    stub = pb2_grpc.InferenceStub(channel)
    return list(stub.Generate(req, timeout=120, metadata=bearer(key)))[-1].usage


@pytest.fixture(scope="module")
def owners(channel: grpc.Channel) -> dict[str, set[str]]:
    """Alice and Bob each sent their prompt through the router until some of its blocks were
    read again (a later run reads the blocks an earlier one stored, on its node or over tcp
    from the other: round-robin); returns each tenant's hot block keys as the admin sees them
    through the router."""
    admin = kvdb_pb2_grpc.KVAdminStub(channel)
    prompts = {"alice": (ALICE, ALICE_IDS), "bob": (BOB, BOB_IDS)}
    seen: dict[str, set[str]] = {}
    deadline = time.monotonic() + 30.0
    while not prompts.keys() <= seen.keys() and time.monotonic() < deadline:
        for tenant, (key, ids) in prompts.items():
            if tenant not in seen:
                generate(channel, key, ids)
        time.sleep(0.3)  # the stored blocks reach the metadata (the next run's plan)
        seen = {}
        for b in admin.Hot(kvdb_pb2.HotRequest(n=1000), timeout=10, metadata=bearer(ROOT)).blocks:
            seen.setdefault(b.tenant, set()).add(b.key)
    assert prompts.keys() <= seen.keys(), f"hot blocks of both tenants never showed: {seen}"
    return seen


def test_a_user_key_sees_only_its_own_hot_blocks_on_the_router(channel, owners) -> None:
    admin = kvdb_pb2_grpc.KVAdminStub(channel)
    mine = admin.Hot(kvdb_pb2.HotRequest(n=1000), timeout=10, metadata=bearer(ALICE))
    assert mine.blocks and not mine.skipped_nodes
    assert {b.tenant for b in mine.blocks} == {"alice"}
    assert {b.key for b in mine.blocks} <= owners["alice"]
    assert not {b.key for b in mine.blocks} & owners["bob"]
    assert {b.node for b in mine.blocks} <= {"prefill-0", "prefill-1", "decode-0"}
    hits = [b.hits for b in mine.blocks]
    assert hits == sorted(hits, reverse=True)  # merged by hits
    assert len(admin.Hot(kvdb_pb2.HotRequest(n=1), timeout=10, metadata=bearer(ALICE)).blocks) == 1
    only_bob = admin.Hot(
        kvdb_pb2.HotRequest(n=1000, tenant="bob"), timeout=10, metadata=bearer(ROOT)
    )
    assert only_bob.blocks and {b.tenant for b in only_bob.blocks} == {"bob"}
    other = kvdb_pb2.HotRequest(n=10, tenant="bob")
    with pytest.raises(grpc.RpcError) as err:
        admin.Hot(other, timeout=10, metadata=bearer(ALICE))
    assert err.value.code() == DENIED


def test_replicas_on_the_router_answer_only_for_the_callers_blocks(channel, owners) -> None:
    admin = kvdb_pb2_grpc.KVAdminStub(channel)

    def replicas(key: str, who: str, tenant: str = "") -> Any:
        request = kvdb_pb2.ReplicasRequest(key=key, tenant=tenant)
        return admin.Replicas(request, timeout=10, metadata=bearer(who))

    alice_key, bob_key = sorted(owners["alice"])[0], sorted(owners["bob"])[0]
    own = replicas(alice_key, ALICE)
    assert {r.source for r in own.replicas} == {"metadata", "local"}  # the nodes' own rows
    assert replicas(bob_key, ROOT).replicas  # an admin: anyone's
    probe, unknown = replicas(bob_key, ALICE), replicas(bytes(range(16)).hex(), ALICE)
    assert not probe.replicas
    probe.key = unknown.key
    assert probe == unknown  # bob's block is not even confirmed to exist
    assert not replicas(bob_key, ROOT, tenant="alice").replicas  # an admin's filter


def test_stats_on_the_router_show_a_user_its_holdings_on_every_node(channel, owners) -> None:
    admin = kvdb_pb2_grpc.KVAdminStub(channel)
    mine = admin.Stats(kvdb_pb2.StatsRequest(), timeout=10, metadata=bearer(ALICE))
    assert not mine.shards and mine.total.puts == 0  # shard-wide counters have no owner
    assert {t.tenant for t in mine.tenants} == {"alice"}
    assert {t.node for t in mine.tenants} == {"prefill-0", "prefill-1", "decode-0"}
    assert sum(t.blocks for t in mine.tenants) >= len(owners["alice"])
    every = admin.Stats(kvdb_pb2.StatsRequest(tenant="bob"), timeout=10, metadata=bearer(ROOT))
    assert {s.node for s in every.shards} == {"prefill-0", "prefill-1", "decode-0"}
    assert every.total.puts == sum(s.puts for s in every.shards) > 0
    assert {t.tenant for t in every.tenants} == {"bob"} and sum(t.blocks for t in every.tenants)
    reset = kvdb_pb2.StatsRequest(reset=True)
    with pytest.raises(grpc.RpcError) as err:
        admin.Stats(reset, timeout=10, metadata=bearer(ALICE))
    assert err.value.code() == DENIED


def test_a_dead_node_is_named_and_the_others_still_answer(cluster, channel, owners, capsys) -> None:
    cluster.kill("decode-0")
    admin = kvdb_pb2_grpc.KVAdminStub(channel)
    started = time.monotonic()
    mine = admin.Hot(kvdb_pb2.HotRequest(n=1000), timeout=10, metadata=bearer(ALICE))
    assert time.monotonic() - started < 5.0  # one short deadline, not one per node
    assert list(mine.skipped_nodes) == ["decode-0"]
    assert mine.blocks and {b.tenant for b in mine.blocks} == {"alice"}
    stats = admin.Stats(kvdb_pb2.StatsRequest(), timeout=10, metadata=bearer(ALICE))
    assert list(stats.skipped_nodes) == ["decode-0"]
    assert {t.node for t in stats.tenants} == {"prefill-0", "prefill-1"}
    code = main(["kvdb", "--server", cluster.address, "--api-key", ALICE, "hot", "-n", "100"])
    out = capsys.readouterr().out
    assert code == 0 and "alice" in out and "bob" not in out
    assert out.rstrip().endswith("not answering, left out: decode-0")
