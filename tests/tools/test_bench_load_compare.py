"""`kvflow bench-load --compare-url/--compare-cmd`: the same levels against another
OpenAI-compatible server, started by the benchmark after kvflow's own server stopped."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import urllib.request
from pathlib import Path

import pytest

from kvflow.tools import cli
from kvflow.tools.bench import _servers, load


def test_compare_url_needs_a_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench-load", "--compare-url", "http://127.0.0.1:1"]) == 2
    assert "--compare-model-name" in capsys.readouterr().err


def test_compare_cmd_needs_a_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench-load", "--compare-cmd", "true"]) == 2
    assert "--compare-cmd needs --compare-url" in capsys.readouterr().err


def test_a_compare_server_that_exits_is_reported(tmp_path: Path) -> None:
    """A start command that dies is an error naming its log, not a hang until the deadline."""
    port = _servers.free_port()
    args = load.add_arguments(argparse.ArgumentParser()).parse_args(
        [
            "--compare-url", f"http://127.0.0.1:{port}", "--compare-model-name", "m",
            "--compare-cmd", f"{shlex.quote(sys.executable)} -c 'raise SystemExit(3)'",
            "--compare-start-s", "120",
        ]
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"compare\.log"):
        load._against_other(args, tmp_path, None)


@pytest.mark.slow
def test_compare_runs_the_same_levels_against_a_second_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kvflow's levels, then the same ones against a second real server (another
    `kvflow serve`, started by --compare-cmd and stopped after)."""
    from kvflow.stages.engine import write_demo_model

    model = write_demo_model(tmp_path / "tiny", preset="tiny", seed=0)
    ports = [_servers.free_port() for _ in range(3)]
    cmd = shlex.join(
        [
            sys.executable, "-m", "kvflow.tools.cli", "serve", "--model", str(model),
            "--data-dir", str(tmp_path / "other"), "--port", str(ports[0]),
            "--http-port", str(ports[1]), "--metrics-port", str(ports[2]),
            "--served-model-name", "other",
        ]
    )  # fmt: skip
    out = tmp_path / "load.json"
    argv = [
        "bench-load", "--model", str(model), "--concurrency", "1,2", "--requests-per-client",
        "1", "--rates", "", "--max-tokens", "4", "--compare-url",
        f"http://127.0.0.1:{ports[1]}", "--compare-model-name", "other", "--compare-cmd", cmd,
        "--shared-prefix-words", "64", "--json", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "compare closed_c2: 2/2 served" in line
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == set(doc["compare"]) == {"closed_c1", "closed_c2"}
    assert doc["shared_prefix_words"] == 64
    for level in [*doc["results"].values(), *doc["compare"].values()]:
        assert level["served"] == level["requests"] and level["http_5xx"] == 0
        assert level["goodput_tokens_per_s"] > 0
        assert level["cached_prompt_tokens"] > 0  # the shared prefix, after the warm-up
    with pytest.raises(OSError):  # the compare server was stopped
        urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/health", timeout=5)


def test_log_tail_names_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "compare.log"
    log.write_text("one\ntwo\nthree\nRuntimeError: operator x does not exist\n")
    assert _servers.log_tail(log, 2) == "three | RuntimeError: operator x does not exist"
    assert _servers.log_tail(tmp_path / "missing.log") == ""
