"""Per-tenant concurrency and rate limits on a real server, both fronts: gRPC
RESOURCE_EXHAUSTED and HTTP 429 with Retry-After, each naming the limit; other tenants are
not affected; a request's place is given back however it ended (no leaks)."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import grpc
import pytest

from kvflow.stages.api import pb2
from tests.e2e.conftest import ServerThread, assert_no_leaks

BODY = json.dumps({"model": "tiny-chat", "prompt": "hello", "max_tokens": 2}).encode()


def post(server: ServerThread) -> tuple[int, dict[str, Any], str | None]:
    assert server.http is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.http.port, timeout=30)
    conn.request("POST", "/v1/completions", body=BODY, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    doc = json.loads(resp.read())
    conn.close()
    return resp.status, doc, resp.getheader("Retry-After")


def grpc_error(server: ServerThread, prompt: str | list[int] = "hello") -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        server.generate(prompt, max_tokens=2)
    return err.value


def wait_idle(server: ServerThread, tenant: str) -> None:
    deadline = time.monotonic() + 10
    while server.cluster.tenant_limits.in_flight(tenant) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.cluster.tenant_limits.in_flight(tenant) == 0


def test_concurrency_limit_on_both_fronts(make_http_server: Any) -> None:
    server = make_http_server(tenant_max_concurrency=1)
    long = pb2.GenerateRequest(
        prompt="a long answer", max_tokens=60, sampling=pb2.SamplingParams(ignore_eos=True)
    )
    stream = server.stub.Generate(long, timeout=60)  # the default tenant's one place
    next(stream)
    err = grpc_error(server)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant_max_concurrency" in err.details() and "'default'" in err.details()
    status, doc, retry = post(server)  # HTTP without keys is the default tenant too
    assert status == 429 and retry == "1"
    assert doc["error"]["type"] == "rate_limit_error"
    assert "tenant_max_concurrency" in doc["error"]["message"]
    ids, _, _ = server.generate("hello", max_tokens=2, tenant="b")  # b is not affected
    assert ids
    stream.cancel()
    wait_idle(server, "default")
    for _ in range(3):  # requests that fail after admission give their place back
        bad = grpc_error(server, [5, 99999])  # out of the vocabulary: the tokenize stage
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert post(server)[0] == 200
    wait_idle(server, "default")
    assert_no_leaks(server)


def test_rate_limit_on_both_fronts(make_http_server: Any) -> None:
    server = make_http_server(tenant_rate_per_s=0.01, tenant_burst=2)
    assert post(server)[0] == 200
    assert server.generate("hello", max_tokens=2)[0]
    status, doc, retry = post(server)
    assert status == 429 and "tenant_rate_per_s" in doc["error"]["message"]
    assert retry is not None and 90 <= int(retry) <= 100  # ~1/0.01 s to the next token
    err = grpc_error(server)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant_rate_per_s" in err.details()
    assert server.generate("hello", max_tokens=2, tenant="b")[0]  # b has its own bucket
    wait_idle(server, "default")
    assert_no_leaks(server)
