"""API keys on the inference API: the tenant comes from the key, a user key cannot see or
evict blocks (the kvdb admin RPCs need an admin key), and no key at all is UNAUTHENTICATED.
On the code before API keys every call below succeeded for anyone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvflow.kvdb.proto import pb2 as kvdb_pb2
from kvflow.kvdb.proto import pb2_grpc as kvdb_pb2_grpc
from kvflow.stages.api import pb2, pb2_grpc
from kvflow.stages.api.auth import ApiKeys, Authenticator
from kvflow.stages.serve.background import BackgroundServer
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


def test_a_user_key_cannot_see_or_evict_blocks(keyed) -> None:
    generate(keyed, ALICE)
    admin = kvdb_pb2_grpc.KVAdminStub(keyed.channel)
    hot = kvdb_pb2.HotRequest(n=10)
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: admin.Hot(hot, timeout=5, metadata=bearer(BOB))) == denied
    evict = kvdb_pb2.EvictRequest()
    assert code_of(lambda: admin.Evict(evict, timeout=5, metadata=bearer(BOB))) == denied
    trace = pb2.ExportTraceRequest()
    stub = pb2_grpc.InferenceStub(keyed.channel)
    assert code_of(lambda: stub.ExportTrace(trace, timeout=5, metadata=bearer(BOB))) == denied
    assert admin.Hot(hot, timeout=5, metadata=bearer(ROOT)).blocks  # an admin sees them
