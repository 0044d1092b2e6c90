"""`kvflow bench-load --temperature`: every request of every level carries it (none without
the flag, so each server samples at its own default); a value outside the OpenAI API's
[0, 2] is refused before any server starts."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest
from aiohttp import web

from kvflow.tools import cli
from kvflow.tools.bench import load
from tests.tools.completion_stub import serve_completions, two_token_completion


async def _levels_against_a_recorder(flags: list[str]) -> list[dict[str, Any]]:
    """Run bench-load's levels against an HTTP server on 127.0.0.1 that streams a two-token
    completion and records each request body."""
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        return await two_token_completion(request)

    runner, port = await serve_completions(completions)
    try:
        args = load.add_arguments(argparse.ArgumentParser()).parse_args(
            ["--concurrency", "2", "--requests-per-client", "2", "--rates", "1",
             "--open-requests", "3", "--max-tokens", "2", *flags]
        )  # fmt: skip
        target = load.Target(f"http://127.0.0.1:{port}", "m", None)
        levels = await load.run(args, target, None)
    finally:
        await runner.cleanup()
    assert set(levels) == {"closed_c2", "open_1x"}
    for level in levels.values():
        assert level.summary()["served"] == level.summary()["requests"]
    return bodies


def test_every_request_carries_the_temperature() -> None:
    bodies = asyncio.run(_levels_against_a_recorder(["--temperature", "0.7"]))
    assert len(bodies) == 4 + 4 + 3  # the warm-up, the closed level, the open level
    assert all(body["temperature"] == 0.7 for body in bodies)
    assert all(body["stream"] and body["ignore_eos"] for body in bodies)


def test_without_the_flag_no_request_names_a_temperature() -> None:
    bodies = asyncio.run(_levels_against_a_recorder([]))
    assert bodies and not any("temperature" in body for body in bodies)


@pytest.mark.parametrize("value", ["-0.5", "2.5"])
def test_a_temperature_outside_the_openai_range_is_refused(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench-load", "--temperature", value, "--concurrency", "1"]) == 2
    assert "--temperature must be in [0, 2]" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rates", "0"], "--rates values must be above 0, not 0"),
        (["--rates", "1,-2"], "--rates values must be above 0, not -2"),
        (["--rates", "fast"], "--rates takes comma-separated numbers, not 'fast'"),
        (["--concurrency", "8,0"], "--concurrency values must be above 0, not 0"),
        (["--concurrency", "1.5"], "--concurrency takes comma-separated numbers, not '1.5'"),
        (["--requests-per-client", "0"], "--requests-per-client must be at least 1, not 0"),
        (["--open-requests", "0"], "--open-requests must be at least 1, not 0"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1, not 0"),
        (["--quiet-s", "-1"], "--quiet-s must be 0 or more seconds, not -1"),
    ],
)
def test_level_flags_that_make_no_level_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench-load", *flags]) == 2
    assert message in capsys.readouterr().err
