"""Bad input over raw HTTP (what an SDK would never send): malformed JSON, wrong types,
invalid UTF-8, bodies over the limit (by Content-Length and streamed without one), prompts over
the model's length, SLO rejections (429 + Retry-After), and a client that goes away
mid-stream (every page, pin and booking freed). The server keeps serving throughout."""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any
from urllib.parse import urlparse

import pytest

from tests.e2e.conftest import ServerThread, assert_no_leaks
from tests.stages.api.conftest import BODY_LIMIT

GOOD = {"model": "tiny-chat", "prompt": "hello", "max_tokens": 2}


def post(
    server: ServerThread, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], http.client.HTTPResponse]:
    assert server.http is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.http.port, timeout=30)
    conn.request(
        "POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else {}, resp


def error_of(server: ServerThread, body: bytes, path: str = "/v1/completions") -> tuple[int, str]:
    status, doc, _ = post(server, path, body)
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["code"] == status
    return status, doc["error"]["message"]


def test_malformed_and_mistyped_bodies(server: ServerThread) -> None:
    assert error_of(server, b"{not json")[0] == 400
    assert error_of(server, b"[1, 2]")[0] == 400
    assert error_of(server, b'{"model": "tiny-chat", "prompt": 5}')[0] == 400
    status, msg = error_of(server, json.dumps({**GOOD, "max_tokens": "2"}).encode())
    assert status == 400 and "max_tokens" in msg
    status, msg = error_of(server, b'{"model": "tiny-chat", "prompt": "\xff\xfe"}')
    assert status == 400 and "UTF-8" in msg
    status, msg = error_of(server, b'{"model": "tiny-chat", "prompt": "\\ud800"}')
    assert status == 400 and "UTF-8" in msg
    assert error_of(server, json.dumps({**GOOD, "model": "other"}).encode())[0] == 404
    assert (
        error_of(server, json.dumps({"text": "a", "input_ids": [1]}).encode(), "/generate")[0]
        == 400
    )
    assert post(server, "/v1/completions", json.dumps(GOOD).encode())[0] == 200


def test_body_over_the_limit_is_refused_before_it_is_read(server: ServerThread) -> None:
    big = json.dumps({**GOOD, "prompt": "a" * BODY_LIMIT}).encode()
    status, _msg = error_of(server, big)
    assert status == 413
    # Declared too large: refused from the headers alone, without sending the body.
    assert server.http is not None
    with socket.create_connection(("127.0.0.1", server.http.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n"
        )
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413")
    # Chunked, no Content-Length: cut as soon as the bytes pass the limit.
    with socket.create_connection(("127.0.0.1", server.http.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"a" * 8192
        for _ in range(BODY_LIMIT // len(chunk) + 2):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413")
    assert post(server, "/v1/completions", json.dumps(GOOD).encode())[0] == 200


def test_prompt_over_the_model_length_is_400(server: ServerThread) -> None:
    cluster = server.cluster
    # More characters than max_model_len tokens could cover: refused without tokenizing.
    chars = cluster.tokenizer.max_token_chars * cluster.max_model_len + 1
    assert chars + 100 < BODY_LIMIT
    status, msg = error_of(server, json.dumps({**GOOD, "prompt": "b" * chars}).encode())
    assert status == 400 and "characters" in msg
    ids = [5] * cluster.max_model_len
    status, msg = error_of(server, json.dumps({**GOOD, "prompt": ids}).encode())
    assert status == 400 and "exceeds" in msg


def test_prompt_too_long_by_characters(make_http_server: Any) -> None:
    server = make_http_server(max_tokens_limit=8)
    t0 = time.perf_counter()
    status, msg = error_of(server, json.dumps({**GOOD, "prompt": "z" * 60_000}).encode())
    assert status == 400 and "characters" in msg, msg
    assert time.perf_counter() - t0 < 5


def test_slo_rejection_is_429_with_retry_after(make_http_server: Any) -> None:
    server = make_http_server(ttft_slo_s=1e-9)
    status, doc, resp = post(server, "/v1/completions", json.dumps(GOOD).encode())
    assert status == 429 and doc["error"]["type"] == "rate_limit_error"
    assert int(resp.getheader("Retry-After")) >= 1
    status, _, _ = post(
        server,
        "/generate",
        json.dumps(
            {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4}}
        ).encode(),
    )
    assert status == 429  # a stream that cannot start gets the status, not an event
    assert_no_leaks(server)


def test_client_gone_mid_stream_frees_everything(make_http_server: Any) -> None:
    server = make_http_server(max_tokens_limit=2000)
    cancelled = server.cluster.serving_metrics.requests.labels(outcome="cancelled")
    before = cancelled._value.get()
    url = urlparse(server.http.url)
    body = json.dumps(
        {
            "model": "tiny-chat",
            "prompt": "hello",
            "max_tokens": 2000,
            "stream": True,
            "extra": 1,
            "ignore_eos": True,
        }
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = b""
        while b"data: " not in got:
            got += sock.recv(4096)
    # the socket is closed: the server notices on its next write and cancels the request
    deadline = time.monotonic() + 20
    while cancelled._value.get() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled._value.get() == before + 1
    assert_no_leaks(server)
    assert post(server, "/v1/completions", json.dumps(GOOD).encode())[0] == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/completions",
            {"model": "tiny-chat", "prompt": "hello", "max_tokens": 4000, "ignore_eos": True},
        ),
        (
            "/generate",
            {
                "text": ["hello", "world"],
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
            },
        ),
    ],
)
def test_client_gone_before_a_non_streaming_answer_cancels_it(
    make_http_server: Any, path: str, body: dict[str, Any]
) -> None:
    server = make_http_server(max_tokens_limit=4000)
    metrics = server.cluster.serving_metrics.requests
    cancelled, ok = metrics.labels(outcome="cancelled"), metrics.labels(outcome="ok")
    before, ok_before = cancelled._value.get(), ok._value.get()
    n = len(body["text"]) if "text" in body else 1
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.http.port), timeout=30) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
        )
        deadline = time.monotonic() + 20
        while server.cluster.pipeline.in_flight() < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.cluster.pipeline.in_flight() == n  # generating, nothing sent yet
    # closed: the server sees the disconnect while it waits and cancels every prompt
    deadline = time.monotonic() + 20
    while cancelled._value.get() < before + n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled._value.get() == before + n
    assert ok._value.get() == ok_before  # none ran to its end
    assert_no_leaks(server)
    assert post(server, "/v1/completions", json.dumps(GOOD).encode())[0] == 200


@pytest.mark.faults
def test_json_nested_past_the_limit_is_400_naming_it(server: ServerThread) -> None:
    """Issue 25: 1,000+ levels gave a 500 (the parser's RecursionError); the depth is
    checked before parsing, brackets inside strings do not count."""
    from kvflow.stages.api.http_io import MAX_JSON_DEPTH

    for depth in (MAX_JSON_DEPTH + 1, 1_000, 4_000):
        body = b'{"model": "tiny-chat", "prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            status, msg = error_of(server, body, path)
            assert status == 400 and "max_json_depth" in msg and str(MAX_JSON_DEPTH) in msg
    nested_ok = json.dumps({**GOOD, "x": [[[1]]], "prompt": "[" * 3000}).encode()
    assert post(server, "/v1/completions", nested_ok)[0] == 200
    assert post(server, "/v1/completions", json.dumps(GOOD).encode())[0] == 200


@pytest.mark.faults
def test_top_k_as_vllm_takes_it(server: ServerThread) -> None:
    """vLLM (sampling_params.py, gpu_input_batch.py): -1 and 0 keep every token, so does any
    top_k at or above the vocabulary; below -1 is a 400."""
    greedy = {**GOOD, "temperature": 0.0, "max_tokens": 4}
    texts = set()
    for top_k in (-1, 0, 10**6, 2**40, 10**30):
        status, doc, _ = post(
            server, "/v1/completions", json.dumps({**greedy, "top_k": top_k}).encode()
        )
        assert status == 200, (top_k, doc)
        texts.add(doc["choices"][0]["text"])
    assert len(texts) == 1
    status, msg = error_of(server, json.dumps({**GOOD, "top_k": -2}).encode())
    assert status == 400 and "top_k" in msg
    sglang = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_k": 10**30}}
    assert post(server, "/generate", json.dumps(sglang).encode())[0] == 200
    bad = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_k": -5}}
    assert error_of(server, json.dumps(bad).encode(), "/generate")[0] == 400
