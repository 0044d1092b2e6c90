"""API keys on the inference API: the tenant comes from the key; a user key sees only its own
tenant's blocks (kvdb Hot, Replicas, Stats), traces and numbers, and cannot evict or call the
other cluster-wide kvdb RPCs; no key at all is UNAUTHENTICATED. On the code before API keys
every call below succeeded for anyone; before tenant-filtered views a user key could not read
Hot, Replicas, Stats or traces at all (and blocks had no owner to filter on)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvflow.kvdb import block_keys
from kvflow.kvdb.proto import pb2 as kvdb_pb2
from kvflow.kvdb.proto import pb2_grpc as kvdb_pb2_grpc
from kvflow.pipeline.tracing import from_chrome_trace
from kvflow.stages.api import pb2, pb2_grpc
from kvflow.stages.api.auth import ApiKeys, Authenticator
from kvflow.stages.hash import namespace_for
from kvflow.stages.serve.background import BackgroundServer
from kvflow.tools.cli import main
from tests.e2e.conftest import base_config

ALICE, BOB, ROOT = "alice-key-0123456789", "bob-key-0123456789ab", "root-key-0123456789ab"


@pytest.fixture(scope="module")
def keyed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    data = tmp_path_factory.mktemp("keys")
    keyfile = data / "keys.txt"
    keyfile.write_text(f"{ALICE} alice user\n{BOB} bob user\n# admin\n{ROOT} - admin\n")
    auth = Authenticator(ApiKeys.load(keyfile))
    server = BackgroundServer(base_config(tiny_model, data / "d"), auth=auth)
    yield server
    server.close()


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def generate(server, key: str | None, tenant: str = "", ids=tuple(range(5, 70))) -> pb2.Usage:
    req = pb2.GenerateRequest(max_tokens=2, tenant=tenant)
    req.token_ids.ids.extend(ids)
    metadata = bearer(key) if key else None
    return list(server.stub.Generate(req, timeout=60, metadata=metadata))[-1].usage


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_no_key_or_an_unknown_key_is_unauthenticated(keyed) -> None:
    assert code_of(lambda: generate(keyed, None)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: generate(keyed, "not-a-key-0123456789")) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    stats = pb2.StatsRequest()
    assert code_of(lambda: keyed.stub.Stats(stats, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED


def test_the_tenant_comes_from_the_key(keyed) -> None:
    ids = tuple(range(100, 180))
    assert generate(keyed, ALICE, ids=ids).cached_tokens == 0
    assert generate(keyed, ALICE, ids=ids).cached_tokens > 0  # alice's own prefix: a hit
    assert generate(keyed, BOB, ids=ids).cached_tokens == 0  # bob learns nothing of it
    # Bob cannot name alice's tenant to probe her prefixes; an admin may act for her.
    assert code_of(lambda: generate(keyed, BOB, tenant="alice", ids=ids)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert generate(keyed, ROOT, tenant="alice", ids=ids).cached_tokens > 0


ALICE_IDS, BOB_IDS = tuple(range(190, 260)), tuple(range(240, 310))
DENIED = grpc.StatusCode.PERMISSION_DENIED


def prompt_keys(server, tenant: str, ids: tuple[int, ...]) -> list[bytes]:
    c = server.cluster
    return block_keys(namespace_for(tenant, c.model_fingerprint, c.layout), list(ids))


@pytest.fixture(scope="module")
def both_served(keyed) -> tuple[list[bytes], list[bytes]]:
    """Alice and Bob each sent their prompt twice (the second run reads the cached blocks,
    so they are "hot"); returns their prompt blocks' keys."""
    for key, ids in ((ALICE, ALICE_IDS), (BOB, BOB_IDS)):
        generate(keyed, key, ids=ids)
        assert generate(keyed, key, ids=ids).cached_tokens > 0
    return prompt_keys(keyed, "alice", ALICE_IDS), prompt_keys(keyed, "bob", BOB_IDS)


def test_a_user_key_sees_only_its_own_hot_blocks(keyed, both_served) -> None:
    alice_keys, bob_keys = (set(ks) for ks in both_served)
    admin = kvdb_pb2_grpc.KVAdminStub(keyed.channel)
    hot = kvdb_pb2.HotRequest(n=1000)
    every = admin.Hot(hot, timeout=5, metadata=bearer(ROOT)).blocks
    seen = {bytes.fromhex(b.key): b.tenant for b in every}
    assert alice_keys & seen.keys() and bob_keys & seen.keys()  # an admin sees both
    assert {seen[k] for k in alice_keys & seen.keys()} == {"alice"}  # owners recorded
    assert {seen[k] for k in bob_keys & seen.keys()} == {"bob"}
    mine = admin.Hot(hot, timeout=5, metadata=bearer(ALICE)).blocks
    assert mine and {b.tenant for b in mine} == {"alice"}
    assert alice_keys & {bytes.fromhex(b.key) for b in mine}
    assert not bob_keys & {bytes.fromhex(b.key) for b in mine}
    # an admin may filter to one tenant; a user may not name another
    only_bob = admin.Hot(
        kvdb_pb2.HotRequest(n=1000, tenant="bob"), timeout=5, metadata=bearer(ROOT)
    )
    assert only_bob.blocks and {b.tenant for b in only_bob.blocks} == {"bob"}
    other = kvdb_pb2.HotRequest(n=10, tenant="bob")
    assert code_of(lambda: admin.Hot(other, timeout=5, metadata=bearer(ALICE))) == DENIED


def test_replicas_of_another_tenants_key_look_like_an_unknown_key(keyed, both_served) -> None:
    alice_keys, bob_keys = both_served
    admin = kvdb_pb2_grpc.KVAdminStub(keyed.channel)

    def replicas(key: bytes, who: str) -> kvdb_pb2.ReplicasResponse:
        request = kvdb_pb2.ReplicasRequest(key=key.hex())
        return admin.Replicas(request, timeout=5, metadata=bearer(who))

    assert replicas(alice_keys[0], ALICE).replicas  # her own block: where it is
    assert replicas(bob_keys[0], ROOT).replicas  # an admin: anyone's
    probe = replicas(bob_keys[0], ALICE)
    unknown = replicas(bytes(range(16)), ALICE)
    assert not probe.replicas
    probe.key = unknown.key
    assert probe == unknown  # bob's block is not even confirmed to exist


def test_a_user_gets_its_own_stats_and_no_cluster_wide_rpc(keyed, both_served) -> None:
    admin = kvdb_pb2_grpc.KVAdminStub(keyed.channel)
    mine = admin.Stats(kvdb_pb2.StatsRequest(), timeout=5, metadata=bearer(ALICE))
    assert not mine.shards and mine.total.puts == 0  # shard-wide counters have no owner
    assert mine.tenants and {t.tenant for t in mine.tenants} == {"alice"}
    assert sum(t.blocks for t in mine.tenants) >= len(both_served[0])
    everyone = admin.Stats(kvdb_pb2.StatsRequest(tenant="bob"), timeout=5, metadata=bearer(ROOT))
    assert everyone.shards and everyone.total.puts > 0
    assert {t.tenant for t in everyone.tenants} == {"bob"}
    for request in (kvdb_pb2.StatsRequest(tenant="bob"), kvdb_pb2.StatsRequest(reset=True)):
        assert code_of(lambda r=request: admin.Stats(r, timeout=5, metadata=bearer(ALICE))) == (
            DENIED
        )
    shard = everyone.shards[0].shard
    calls = {
        "Evict": kvdb_pb2.EvictRequest(shard=shard, tier="dram", bytes=1 << 30),
        "Nodes": kvdb_pb2.NodesRequest(),
        "Shards": kvdb_pb2.ShardsRequest(),
        "Tiers": kvdb_pb2.TiersRequest(),
    }
    for name, request in calls.items():
        call = getattr(admin, name)
        assert code_of(lambda c=call, r=request: c(r, timeout=5, metadata=bearer(ALICE))) == (
            DENIED
        ), name
    # nothing was evicted: alice's blocks still serve her prompt from the cache
    assert generate(keyed, ALICE, ids=ALICE_IDS).cached_tokens > 0


def test_a_user_exports_only_its_own_traces(keyed, both_served) -> None:
    stub = pb2_grpc.InferenceStub(keyed.channel)

    def tenants(who: str) -> list[str]:
        reply = stub.ExportTrace(pb2.ExportTraceRequest(), timeout=5, metadata=bearer(who))
        traces = from_chrome_trace(json.loads(reply.chrome_trace_json))
        return [t.attrs.get("tenant") for t in traces]

    assert set(tenants(ROOT)) >= {"alice", "bob"}
    assert tenants(ALICE) and set(tenants(ALICE)) == {"alice"}
    assert set(tenants(BOB)) == {"bob"}
    last = pb2.ExportTraceRequest(last_n=1)
    reply = stub.ExportTrace(last, timeout=5, metadata=bearer(BOB))
    assert [t.attrs["tenant"] for t in from_chrome_trace(json.loads(reply.chrome_trace_json))] == [
        "bob"
    ]
    stats = stub.Stats(pb2.StatsRequest(), timeout=5, metadata=bearer(BOB))
    assert dict(stats.router) == {"tenant_in_flight": 0.0} and not stats.instances
    assert stub.Stats(pb2.StatsRequest(), timeout=5, metadata=bearer(ROOT)).instances


def test_the_kvdb_cli_sends_the_key(keyed, both_served, capsys) -> None:
    def cli(*argv: str) -> tuple[int, str, str]:
        code = main(["kvdb", "--server", keyed.address, *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = cli("--api-key", ALICE, "--json", "hot", "-n", "100")
    assert code == 0 and {b["tenant"] for b in json.loads(out)} == {"alice"}
    code, out, _ = cli("--api-key", ROOT, "--json", "hot", "-n", "1000", "--tenant", "bob")
    assert code == 0 and {b["tenant"] for b in json.loads(out)} == {"bob"}
    code, out, _ = cli("--api-key", ALICE, "stats")
    assert code == 0 and out.split()[:3] == ["TENANT", "SHARD", "BLOCKS"] and "bob" not in out
    code, _, err = cli(
        "--api-key", ALICE, "evict", "--shard", "x", "--tier", "dram", "--bytes", "1"
    )
    assert code == 1 and "PERMISSION_DENIED" in err
    code, _, err = cli("hot")  # no key, no cluster secret: a keyed server refuses
    assert code == 1 and "UNAUTHENTICATED" in err
