"""`kvflow bench-load --interleave`: kvflow's server and the compare server up at once, taking
turns level by level (A B, B A, ...), each sent the same prompts at the same arrivals as
without the flag; the flag needs a compare server started beside the one it starts here."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvflow.tools import cli
from kvflow.tools.bench import _servers, load
from tests.docs.blocks import block
from tests.tools.completion_stub import serve_completions, two_token_completion


class Recorder:
    """An HTTP server on 127.0.0.1, in a thread of its own, that streams a two-token
    completion and records each request's prompt and when it came."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, str]] = []
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(60), "the recorder did not start"

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((time.monotonic(), body["prompt"]))
        return await two_token_completion(request)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self.loop.run_forever()

    def target(self, name: str) -> load.Target:
        return load.Target(f"http://127.0.0.1:{self.port}", name, None)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(60)


@pytest.fixture
def recorders() -> Iterator[tuple[Recorder, Recorder]]:
    pair = Recorder(), Recorder()
    try:
        yield pair
    finally:
        for r in pair:
            r.close()


FLAGS = ["--concurrency", "1,2", "--requests-per-client", "2", "--rates", "1,2",
         "--open-requests", "3", "--max-tokens", "2", "--quiet-s", "0", "--seed", "5"]  # fmt: skip


def _args(extra: list[str]) -> argparse.Namespace:
    return load.add_arguments(argparse.ArgumentParser()).parse_args([*FLAGS, *extra])


def test_the_servers_take_turns_with_the_same_prompts(recorders: tuple[Recorder, Recorder]) -> None:
    a, b = recorders
    kvflow, compare, turns = load._turns(_args([]), a.target("a"), b.target("b"))
    names = ["closed_c1", "closed_c2", "open_1x", "open_2x"]
    assert list(kvflow) == list(compare) == names
    assert [(t["level"], t["server"]) for t in turns] == [
        ("closed_c1", "kvflow"), ("closed_c1", "compare"),
        ("closed_c2", "compare"), ("closed_c2", "kvflow"),
        ("open_1x", "kvflow"), ("open_1x", "compare"),
        ("open_2x", "compare"), ("open_2x", "kvflow"),
    ]  # fmt: skip
    for levels in (kvflow, compare):
        assert all(lv.summary()["served"] == lv.summary()["requests"] for lv in levels.values())
    # the warm-up (2 x 2), then 1 x 2, 2 x 2 and 3 + 3 prompts, the same on both servers
    assert sorted(p for _, p in a.seen) == sorted(p for _, p in b.seen)
    assert len(a.seen) == 4 + 2 + 4 + 3 + 3
    # one server at a time: each turn's requests all came after the turn before it began
    starts = [t["at"] for t in turns]
    assert starts == sorted(starts)


def test_interleaved_levels_send_what_a_single_server_run_sends(
    recorders: tuple[Recorder, Recorder],
) -> None:
    """The same seed draws the same prompts and Poisson gaps with or without --interleave."""
    a, b = recorders
    args = _args([])
    alone = asyncio.run(load.run(args, b.target("b"), None))
    single = [p for _, p in b.seen]
    b.seen.clear()
    load._turns(args, a.target("a"), b.target("b"))
    assert sorted(p for _, p in b.seen) == sorted(single)
    assert set(alone) == {"closed_c1", "closed_c2", "open_1x", "open_2x"}
    prompts = load.Prompts(args.seed, args.prompt_words)
    load.closed_plans(args, prompts)
    plans = load.open_plans(args, prompts, 4.0)  # the rates: multiples of the capacity
    assert [p.rate for p in plans] == [4.0, 8.0]
    assert all(len(p.gaps) == len(p.texts) == 3 for p in plans)


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--compare-url", "http://127.0.0.1:1", "--compare-model-name", "m", "--url",
         "http://127.0.0.1:2", "--model-name", "m"],
        ["--compare-url", "http://127.0.0.1:1", "--compare-model-name", "m",
         "--baseline-python", sys.executable],
    ],
)  # fmt: skip
def test_interleave_needs_a_compare_server_beside_its_own(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench-load", "--interleave", *flags]) == 2
    assert "--interleave takes turns" in capsys.readouterr().err


@pytest.mark.slow
def test_the_documented_interleaved_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/performance.md's block: two real `kvflow serve` (the second started by
    --compare-cmd) up at once, taking turns; both stopped at the end."""
    from kvflow.stages.engine import write_demo_model

    model = write_demo_model(tmp_path / "tiny", preset="tiny", seed=0)
    port = _servers.free_port()
    text = block("performance.md", "bench-load-interleave").replace("\\\n", " ")
    text = text.replace("MODEL_DIR", str(model)).replace("OTHER_DIR", str(tmp_path / "other"))
    text = text.replace("8392", str(port))
    argv = shlex.split(text)
    assert argv[:2] == ["kvflow", "bench-load"]
    at = argv.index("--compare-cmd") + 1
    assert argv[at].startswith("kvflow serve ")  # run by this interpreter, as `kvflow`
    argv[at] = shlex.join([sys.executable, "-m", "kvflow.tools.cli"]) + argv[at][len("kvflow") :]
    out = tmp_path / "load.json"
    assert cli.main([*argv[1:], "--json", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "compare open_2x: 4/4 served" in line
    doc: dict[str, Any] = json.loads(out.read_text())
    assert doc["interleave"] is True and doc["compare_error"] is None
    assert list(doc["results"]) == list(doc["compare"]) == ["closed_c1", "closed_c2", "open_2x"]
    servers = [t["server"] for t in doc["turns"]]
    assert servers == ["kvflow", "compare", "compare", "kvflow", "kvflow", "compare"]
    for level in [*doc["results"].values(), *doc["compare"].values()]:
        assert level["served"] == level["requests"] and level["http_5xx"] == 0
        if Path("/proc/stat").is_file():  # each level measured its own server's processes
            assert level["cores"]["server"] > 0
    with pytest.raises(OSError):  # the compare server was stopped
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)


def test_a_dropped_connection_says_what_it_raised() -> None:
    """A server that closes the connection without an answer: a ``conn`` refusal, and the
    level's summary and line name the error."""

    async def drop(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()
        raise web.HTTPInternalServerError()  # never sent: the connection is gone

    async def level() -> load.Level:
        runner, port = await serve_completions(drop)
        try:
            target = load.Target(f"http://127.0.0.1:{port}", "m", None)
            return await load.closed_loop(target, [["one prompt"]], 2)
        finally:
            await runner.cleanup()

    summary = asyncio.run(level()).summary()
    assert summary["refused"] == {"conn": 1}
    assert list(summary["conn_errors"]) == ["ServerDisconnectedError: Server disconnected"]
    assert "refused conn:1 (1 x ServerDisconnectedError" in load._short(summary)
