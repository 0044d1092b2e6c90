"""The embedded server under pressure, with real clients (openai, grpc) on 127.0.0.1: a burst
beyond the engine's staging pages waits and is all served (no 503); a full admission queue
answers 429 with Retry-After naming the limit (RESOURCE_EXHAUSTED on gRPC); a client that
goes away while queued frees its place; queue time is a trace span and a histogram; slow
HTTP clients are closed."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import openai
import pytest

from kvflow.stages.api import pb2
from kvflow.stages.serve.config import HttpConfig
from tests.e2e.conftest import ServerThread, assert_no_leaks, base_config

PROMPT_IDS = [(7 * i + 3) % 200 + 1 for i in range(40)]  # 3 pages of 16 tokens


def client(server: ServerThread) -> openai.OpenAI:
    assert server.http is not None
    return openai.OpenAI(
        base_url=server.http.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def metric(server: ServerThread, name: str) -> float:
    for line in server.cluster.metrics.render().decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def hold_running(server: ServerThread, max_tokens: int = 60) -> Any:
    """A long gRPC stream that holds the one running place (its first token is in) until it
    has decoded ``max_tokens`` or is cancelled."""
    req = pb2.GenerateRequest(
        prompt="hold", max_tokens=max_tokens, sampling=pb2.SamplingParams(ignore_eos=True)
    )
    stream = server.stub.Generate(req, timeout=120)
    next(stream)
    return stream


@pytest.fixture
def make(chat_model: Any, tmp_path: Any) -> Any:
    servers: list[ServerThread] = []

    def build(**overrides: Any) -> ServerThread:
        s = ServerThread(
            base_config(chat_model, tmp_path / f"d{len(servers)}", **overrides),
            http=HttpConfig(port=0, header_timeout_s=1.0, body_timeout_s=1.0),
        )
        servers.append(s)
        return s

    yield build
    for s in servers:
        s.close()


def test_burst_beyond_the_staging_pages_is_all_served(make: Any) -> None:
    """8 staging pages hold 2 requests of 3 pages; 24 at once (HTTP and gRPC) all finish."""
    server = make(staging_pages=8, max_tokens_limit=64)
    c = client(server)

    def over_http(i: int) -> int:
        out = c.completions.create(model="tiny-chat", prompt=PROMPT_IDS, max_tokens=6, seed=i)
        return out.usage.completion_tokens

    def over_grpc(i: int) -> int:
        ids, _, _ = server.generate(PROMPT_IDS, max_tokens=6, request_id=f"g{i}")
        return len(ids)

    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(over_http, i) for i in range(16)]
        futures += [pool.submit(over_grpc, i) for i in range(8)]
        done = [f.result(timeout=180) for f in futures]
    assert len(done) == 24 and all(1 <= n <= 6 for n in done)  # served, none refused
    assert metric(server, "kvflow_admission_no_room_total") > 0  # they did wait for pages
    assert metric(server, "kvflow_admission_queue_seconds_count") >= 24
    assert_no_leaks(server)
    assert server.cluster.admission.running() == 0


@pytest.mark.slow  # about 5 s: 20 requests of 24 tokens on one engine
def test_requests_outgrowing_the_kv_pages_after_their_first_token_wait(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """7 KV pages: two requests of 3 prompt pages each start decoding, then outgrow them (40 +
    24 tokens are 4 pages each). The one that finds no page after its first tokens waits at
    its place and is run again; the client gets exactly the tokens and text of the request
    alone, once (no 503, no text twice)."""
    server = make(num_pages=7, max_tokens_limit=64)
    prompts = [[(k * i + 5) % 250 + 3 for i in range(40)] for k in (3, 7, 11, 13)]
    eos = pb2.SamplingParams(ignore_eos=True)
    alone = [server.generate(ids, max_tokens=24, sampling=eos) for ids in prompts]
    c = client(server)

    def over_http(i: int) -> str:
        stream = c.completions.create(
            model="tiny-chat",
            prompt=prompts[i % 4],
            max_tokens=24,
            stream=True,
            extra_body={"ignore_eos": True},
        )  # an error event after the first token raises here
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    def over_grpc(i: int) -> list[int]:
        ids, _, _ = server.generate(prompts[i % 4], max_tokens=24, sampling=eos)
        return ids

    caplog.set_level(logging.INFO, logger="kvflow.stages.api.generation")
    with ThreadPoolExecutor(16) as pool:
        texts = [pool.submit(over_http, i) for i in range(8)]
        tokens = [pool.submit(over_grpc, i) for i in range(8)]
        got_text = [f.result(timeout=180) for f in texts]
        got_tokens = [f.result(timeout=180) for f in tokens]
    assert got_text == [alone[i % 4][2] for i in range(8)]
    assert got_tokens == [alone[i % 4][0] for i in range(8)]
    started = [r for r in caplog.records if "no room" in r.getMessage()]
    assert any(" after 0 tokens" not in r.getMessage() for r in started), [
        r.getMessage() for r in started
    ]  # some did run out after their first tokens
    assert_no_leaks(server)
    assert server.cluster.admission.running() == 0


def post(server: ServerThread, body: dict[str, Any]) -> tuple[int, dict[str, Any], str | None]:
    assert server.http is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.http.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    doc = json.loads(resp.read())
    conn.close()
    return resp.status, doc, resp.getheader("Retry-After")


def test_full_queue_answers_429_naming_the_limit(make: Any) -> None:
    # The hold must outlast three refusals on a loaded machine: 60 tokens of the tiny model
    # were decoded before the third once (its place went to the queued request); it is
    # cancelled below.
    server = make(max_running_requests=1, max_queued_requests=1, max_tokens_limit=1024)
    adm = server.cluster.admission
    stream = hold_running(server, max_tokens=1000)
    body = {"model": "tiny-chat", "prompt": "queued", "max_tokens": 2}
    queued: list[Any] = []
    t = threading.Thread(target=lambda: queued.append(post(server, body)))
    t.start()
    wait_for(lambda: adm.waiting() == 1, "a request waiting")
    status, doc, retry = post(server, body)
    assert status == 429 and retry is not None and int(retry) >= 1
    assert doc["error"]["type"] == "rate_limit_error"
    assert "max_queued_requests" in doc["error"]["message"]
    with pytest.raises(openai.RateLimitError) as err:  # the openai client sees the same
        client(server).completions.create(model="tiny-chat", prompt="x", max_tokens=2)
    assert "max_queued_requests" in str(err.value)
    with pytest.raises(grpc.RpcError) as rpc:
        server.generate("x", max_tokens=2)
    assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued_requests" in rpc.value.details()
    trailers = dict(rpc.value.trailing_metadata() or ())
    assert int(trailers["retry-after"]) >= 1
    stream.cancel()
    t.join(60)
    assert queued and queued[0][0] == 200  # the queued one was served once there was room
    assert metric(server, 'kvflow_admission_refused_total{limit="max_queued_requests"}') == 3
    assert_no_leaks(server)


def test_client_gone_while_queued_frees_its_place(make: Any) -> None:
    server = make(max_running_requests=1, max_queued_requests=1)
    adm = server.cluster.admission
    stream = hold_running(server)
    assert server.http is not None
    # HTTP: a raw request, then the socket closed while it waits
    sock = socket.create_connection(("127.0.0.1", server.http.port), timeout=30)
    body = json.dumps({"model": "tiny-chat", "prompt": "q", "max_tokens": 2}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    wait_for(lambda: adm.waiting() == 1, "the HTTP request queued")
    sock.close()
    wait_for(lambda: adm.waiting() == 0, "its place freed after the disconnect")
    # gRPC: a call cancelled while it waits
    call = server.stub.Generate(pb2.GenerateRequest(prompt="q", max_tokens=2), timeout=60)
    wait_for(lambda: adm.waiting() == 1, "the gRPC call queued")
    call.cancel()
    wait_for(lambda: adm.waiting() == 0, "its place freed after the cancel")
    # the streaming HTTP answer: the client goes away before the first token
    sock = socket.create_connection(("127.0.0.1", server.http.port), timeout=30)
    body = json.dumps({"model": "tiny-chat", "prompt": "q", "max_tokens": 2, "stream": True})
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())
    )
    wait_for(lambda: adm.waiting() == 1, "the streaming request queued")
    sock.close()
    wait_for(lambda: adm.waiting() == 0, "its place freed")
    stream.cancel()
    ids, _, _ = server.generate("after", max_tokens=2)  # the server serves on
    assert len(ids) == 2
    assert_no_leaks(server)
    assert adm.running() == 0


def test_queue_time_is_a_span(make: Any) -> None:
    server = make()
    server.generate("traced", max_tokens=2, request_id="traced-1")
    traces = server.cluster.tracer.traces(last=10)
    trace = next(t for t in traces if t.request_id == "traced-1")
    queue = [s for s in trace.spans if s.name == "queue"]
    assert len(queue) == 1 and "queued_ms" in queue[0].attrs
    assert queue[0].attrs["priority"] == "interactive"


def test_slow_header_connections_are_closed(make: Any) -> None:
    """200 connections that never finish their headers are all closed within the header
    timeout (1 s here), and the server answers others meanwhile."""
    server = make()
    assert server.http is not None
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", server.http.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never ends the headers
        socks.append(s)
    assert post(server, {"model": "tiny-chat", "prompt": "hi", "max_tokens": 2})[0] == 200
    deadline = time.monotonic() + 30
    for s in socks:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        assert s.recv(1024) == b""  # closed by the server
        s.close()


def test_slow_body_gets_408(make: Any) -> None:
    server = make()
    assert server.http is not None
    s = socket.create_connection(("127.0.0.1", server.http.port), timeout=30)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    s.close()
    assert data.startswith(b"HTTP/1.1 408")
