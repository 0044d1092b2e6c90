"""Resuming an answer on another server: GenerateRequest.skip_tokens and InferenceClient.

The servers are real embedded servers (tiny model, real gRPC on 127.0.0.1); the one that
"dies" mid-answer is stopped, which ends its open streams with UNAVAILABLE.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import grpc
import pytest

from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient, parse_servers
from kvflow.tools.cli import main
from tests.e2e.conftest import ServerThread, base_config


def _request(prompt: str, **fields: object) -> pb2.GenerateRequest:
    req = pb2.GenerateRequest(**fields)  # type: ignore[arg-type]
    req.prompt = prompt
    return req


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens there once the socket closes


def test_skip_tokens_sends_only_the_rest_of_the_answer(server):
    full, usage, text = server.generate("the kv cache flows", max_tokens=12)
    rest, rest_usage, rest_text = server.generate(
        "the kv cache flows", max_tokens=12, skip_tokens=5
    )
    assert len(full) == usage.completion_tokens > 5
    assert rest == full[5:]
    assert rest_usage.completion_tokens == usage.completion_tokens  # generated, not all sent
    assert rest_text and text.endswith(rest_text) and len(rest_text) < len(text)


def test_skip_tokens_beyond_max_tokens_is_invalid(server):
    with pytest.raises(grpc.RpcError) as err:
        server.generate("hello", max_tokens=4, skip_tokens=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "skip_tokens 5" in err.value.details()
    assert server.generate("hello", max_tokens=4)[0]  # still serving


def test_parse_servers_names_the_bad_entry():
    assert parse_servers("a:1, b:2") == ["a:1", "b:2"]
    for bad in ("", "hostonly", "h:0", "h:port", ":80"):
        with pytest.raises(ValueError):
            parse_servers(bad)
    with pytest.raises(ValueError, match="'h:x'"):
        parse_servers("a:1,h:x")


def test_an_unreachable_router_is_skipped(server):
    expected, _, _ = server.generate("fail over", max_tokens=8)
    with InferenceClient([f"127.0.0.1:{_closed_port()}", server.address]) as client:
        msgs = list(client.generate(_request("fail over", max_tokens=8), timeout=60))
        assert [t for m in msgs for t in m.token_ids] == expected
        assert client.failovers == 1
        # The next request goes straight to the server that answered.
        list(client.generate(_request("fail over", max_tokens=2), timeout=60))
        assert client.failovers == 1


def test_a_router_lost_mid_answer_is_resumed_on_the_next_with_the_same_tokens(make_server):
    first = make_server(max_tokens_limit=4096)
    second = make_server(max_tokens_limit=4096)
    sampling = pb2.SamplingParams(temperature=0.9, top_k=50, ignore_eos=True)
    req = _request("a long sampled answer", max_tokens=1500, sampling=sampling, request_id="r1")
    client = InferenceClient([first.address, second.address], seed=3)
    tokens: list[int] = []
    finished = []
    stopper = None
    for i, msg in enumerate(client.generate(req, timeout=120)):
        tokens.extend(msg.token_ids)
        if i == 0:  # the first router goes away while the answer streams
            stopper = threading.Thread(target=first.close)
            stopper.start()
        if msg.finished:
            finished.append(msg)
    assert stopper is not None
    stopper.join()
    client.close()
    assert client.failovers == 1
    assert len(finished) == 1 and finished[0].usage.request_id == "r1-r1"
    # The whole answer, as one server gives it with the seed the client chose.
    seeded = pb2.SamplingParams(
        temperature=0.9, top_k=50, ignore_eos=True, seed=random.Random(3).getrandbits(63)
    )
    expected, _, _ = second.generate("a long sampled answer", max_tokens=1500, sampling=seeded)
    assert len(tokens) == 1500
    assert tokens == expected


def test_generate_cli_takes_several_servers(server, capsys):
    dead = f"127.0.0.1:{_closed_port()}"
    capsys.readouterr()
    args = ["generate", "--server", f"{dead},{server.address}", "--prompt", "hi", "--json"]
    assert main([*args, "--max-tokens", "3"]) == 0
    assert '"completion_tokens": 3' in capsys.readouterr().out
    with pytest.raises(SystemExit, match="bad server address"):
        main(["generate", "--server", "nohost", "--prompt", "hi"])


def test_the_only_router_coming_back_is_waited_for(tiny_model, tmp_path):
    """One router, restarted (as the supervisor does): the request waits for it."""
    port = _closed_port()
    started: list[ServerThread] = []

    def start_later() -> None:
        time.sleep(1.5)
        started.append(ServerThread(base_config(tiny_model, tmp_path / "data"), port=port))

    starter = threading.Thread(target=start_later)
    starter.start()
    try:
        with InferenceClient([f"127.0.0.1:{port}"]) as client:
            msgs = list(client.generate(_request("come back", max_tokens=4), timeout=60))
            assert sum(len(m.token_ids) for m in msgs) == 4
            assert client.failovers >= 1
    finally:
        starter.join()
        for server in started:
            server.close()


def test_a_router_that_stays_down_is_given_up_after_the_retry_window():
    client = InferenceClient([f"127.0.0.1:{_closed_port()}"], retry_for_s=0.5)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(_request("nobody", max_tokens=2), timeout=60))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 10
    assert client.failovers >= 1
    client.close()
