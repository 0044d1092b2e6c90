"""`kvflow bench-side`: issue 31's table against kvflow and another OpenAI-compatible server in
one run. No test runs vLLM: the "other" server here is a second real `kvflow serve`, started by
--compare-cmd, so the whole harness (start-up, every row, the greedy comparison, the prefix
cache report, the ratio table) runs against two real servers."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvflow.tools import cli
from kvflow.tools.bench import _servers, side
from kvflow.tools.bench.load import Prompts
from tests.docs.blocks import block

SMALL = [
    "--cold-tokens", "64", "--long-tokens", "256", "--system-tokens", "128", "--questions", "2",
    "--ttft-max-tokens", "4", "--decode-max-tokens", "8", "--clients", "2",
    "--client-requests", "1", "--client-prompt-tokens", "32", "--client-max-tokens", "4",
    "--tail-tokens", "16", "--burst", "4", "--burst-tokens", "48", "--burst-max-tokens", "4",
]  # fmt: skip


def test_compare_url_needs_a_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench-side", "--compare-url", "http://127.0.0.1:1"]) == 2
    assert "--compare-model-name" in capsys.readouterr().err


def test_compare_cmd_needs_a_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench-side", "--compare-cmd", "true"]) == 2
    assert "--compare-cmd needs --compare-url" in capsys.readouterr().err


def test_rows_must_be_known(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench-side", "--rows", "burst,nope"])
    assert exited.value.code == 2
    assert "unknown row(s) ['nope']" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rounds", "--cold-samples"])
def test_counts_below_one_are_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench-side", flag, "0"]) == 2
    assert f"{flag} must be at least 1, not 0" in capsys.readouterr().err


def test_compare_server_args_exclude_a_compare_url(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench-side", "--compare-server-args=--colocate", "--compare-url", "http://x:1"]
    assert cli.main([*argv, "--compare-model-name", "m"]) == 2
    assert "exclude each other" in capsys.readouterr().err


@pytest.mark.slow
def test_two_kvflow_configurations_on_chosen_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--compare-server-args: the other column is kvflow again with other flags (here
    disaggregated against colocated), only the --rows asked for are measured, and the two
    modes' greedy texts are the same request by request."""
    from kvflow.stages.engine import write_demo_model

    model = write_demo_model(tmp_path / "tiny", preset="tiny", seed=0)
    argv = [
        "bench-side", "--model", str(model), *SMALL, "--rows", "clients,burst",
        "--server-args=--no-colocate", "--compare-server-args=--colocate --mixed-chunk 16",
    ]  # fmt: skip
    doc, _ = _run(argv, tmp_path / "side.json", capsys)
    (r,) = doc["rounds"]
    assert r["order"] == ["kvflow", "other"]
    measured = {"startup_s", "clients_tok_s", "clients_ttft_p99_s", "burst_all_done_s"}
    for who in ("kvflow", "other"):
        assert set(r[who]["values"]) == measured and not r[who]["failed"]
        assert all(v is not None and v > 0 for v in r[who]["values"].values())
    assert r["greedy"]["compared"] == 1 + 2 * 1 + 4 * 2  # settle, clients x 1, burst x 2
    assert r["greedy"]["identical"] == r["greedy"]["compared"]


def test_texts_are_sized_in_tokens_and_share_no_prefix(tmp_path: Path) -> None:
    from kvflow.stages.engine import write_demo_model

    texts = side.Texts(write_demo_model(tmp_path / "tiny", preset="tiny", seed=0), seed=0)
    short, long = texts.text("cold-short", 512), texts.text("cold-long", 2000)
    assert 490 <= texts.count(short) <= 520 and 1960 <= texts.count(long) <= 2010
    assert texts.text("cold-long", 2000) == long  # seeded
    assert short[:24] != long[:24]  # each cold row its own text: no accidental prefix hit
    assert texts.text("cold-short-1", 512)[:24] != short[:24]  # and each cold sample
    assert side.Texts(tmp_path / "tiny", seed=1).text("cold-long", 2000) != long


def test_shared_prefix_prompts_start_alike() -> None:
    plain, shared = Prompts(0, 8), Prompts(0, 8, prefix_words=100)
    a, b = shared.take(2)
    assert a.startswith(shared.prefix) and b.startswith(shared.prefix) and a != b
    assert len(shared.prefix.split()) == 100
    assert a == shared.prefix + plain.next()  # the same own words, after the prefix


def test_table_says_who_is_ahead() -> None:
    args = side.add_arguments(argparse.ArgumentParser()).parse_args([])
    rounds = [
        {
            "kvflow": {"values": {"ttft_cold_short_s": 1.0, "decode_tok_s": 30.0}},
            "other": {"values": {"ttft_cold_short_s": 2.0, "decode_tok_s": 20.0}},
        },
        {
            "kvflow": {"values": {"ttft_cold_short_s": 1.5, "decode_tok_s": 10.0}},
            "other": {"values": {"ttft_cold_short_s": 2.0, "decode_tok_s": 20.0}},
        },
    ]
    rows = {r["row"]: r for r in side.table(args, rounds)}
    assert rows["ttft_cold_short_s"]["ratio"] == [0.5, 0.75]
    assert rows["ttft_cold_short_s"]["kvflow_ahead"] is True  # lower is better, both rounds
    assert rows["decode_tok_s"]["ratio"] == [1.5, 0.5]
    assert rows["decode_tok_s"]["kvflow_ahead"] is False  # behind in one round
    assert side._verdict(rows["ttft_cold_short_s"]) == "0.50-0.75x (kvflow ahead)"
    assert side._verdict(rows["decode_tok_s"]) == "0.50-1.50x (kvflow mixed)"
    assert side._verdict({**rows["decode_tok_s"], "ratio": [0.5], "kvflow_ahead": False}) == (
        "0.50x (kvflow behind)"
    )
    assert rows["startup_s"]["ratio"] == [] and rows["startup_s"]["kvflow_ahead"] is None
    assert rows["ttft_cold_long_s"]["label"] == "TTFT, cold ~2,000 tokens (median of 5)"
    one = side.add_arguments(argparse.ArgumentParser()).parse_args(["--cold-samples", "1"])
    assert side.labels(one)["ttft_cold_short_s"] == "TTFT, cold ~512 tokens"


def test_greedy_match_names_the_requests_that_differ() -> None:
    a = side.Run(texts={"x/0": "same", "y/0": "one", "z/0": "only here"})
    b = side.Run(texts={"x/0": "same", "y/0": "two"})
    assert side.greedy_match(a, b) == {"compared": 2, "identical": 1, "differ": ["y/0"]}


def _run(argv: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    code = cli.main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    return json.loads(out.read_text()), printed


@pytest.mark.slow
def test_doc_block_runs_every_row_against_kvflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The docs' small command: every row has a value, the prefix-hit row was a hit."""
    argv = shlex.split(block("benchmarks.md", "bench-side-small").replace("\\\n", " "))[1:]
    doc, printed = _run(argv, tmp_path / "side.json", capsys)
    (r,) = doc["rounds"]
    values = r["kvflow"]["values"]
    assert set(values) == {row.name for row in side.ROWS}
    assert all(v is not None and v > 0 for v in values.values()), values
    assert r["kvflow"]["prefix_cache"]["hit_row_cached_tokens"] > 0
    assert r["kvflow"]["prefix_cache"]["counters"]["hit_tokens"] > 0
    assert r["kvflow"]["texts"]["settle/0"]  # the untimed cold prompt before the rows
    samples = r["kvflow"]["samples"]  # each cold row: the median of 5 prompts of their own
    for row, key in (("ttft_cold_short_s", "cold_short"), ("ttft_cold_long_s", "cold_long")):
        assert len(samples[row]) == 5 and values[row] == statistics.median(samples[row])
        assert {key, *(f"{key}/{i}" for i in range(1, 5))} <= set(r["kvflow"]["texts"])
    assert printed.splitlines()[-1].startswith("bench side kvflow (round 1, seed 0)")


@pytest.mark.slow
def test_side_by_side_with_a_second_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kvflow, then a second `kvflow serve` started by --compare-cmd: same prompts, so the
    greedy texts are the same request by request; the table has a ratio on every row."""
    from kvflow.stages.engine import write_demo_model

    model = write_demo_model(tmp_path / "tiny", preset="tiny", seed=0)
    (model / "chat_template.jinja").write_text(side.CHATML)
    ports = [_servers.free_port() for _ in range(3)]
    cmd = shlex.join(
        [
            sys.executable, "-m", "kvflow.tools.cli", "serve", "--model", str(model),
            "--data-dir", str(tmp_path / "other"), "--port", str(ports[0]),
            "--http-port", str(ports[1]), "--metrics-port", str(ports[2]),
            "--served-model-name", "other",
        ]
    )  # fmt: skip
    url = f"http://127.0.0.1:{ports[1]}"
    argv = [
        "bench-side", "--model", str(model), *SMALL, "--compare-url", url,
        "--compare-model-name", "other", "--compare-cmd", cmd,
    ]  # fmt: skip
    doc, printed = _run(argv, tmp_path / "side.json", capsys)
    (r,) = doc["rounds"]
    assert r["order"] == ["kvflow", "other"]
    for who in ("kvflow", "other"):
        assert all(v is not None and v > 0 for v in r[who]["values"].values()), (who, r[who])
        assert not r[who]["failed"]
    assert r["greedy"]["compared"] >= 20 and r["greedy"]["differ"] == []
    assert doc["greedy"]["identical"] == doc["greedy"]["compared"] == r["greedy"]["compared"]
    assert all(len(row["ratio"]) == 1 for row in doc["table"])
    lines = printed.splitlines()
    assert lines[0].startswith("bench side kvflow") and lines[1].startswith("bench side other")
    assert lines[2] == "| | kvflow | other | kvflow/other |"
    assert len([x for x in lines if x.startswith("| ")]) == 1 + len(side.ROWS) + 1
    assert "greedy texts identical in" in lines[-1]
    with pytest.raises(OSError):  # the other server was stopped
        urllib.request.urlopen(url + "/health", timeout=5)


@pytest.mark.slow
def test_interleaved_rounds_alternate_the_servers_row_by_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--interleave: both servers are up at once and each row group runs on one and then on
    the other, the order swapped from group to group (a second kvflow as the other here:
    the docs' command)."""
    argv = shlex.split(block("benchmarks.md", "bench-side-interleave"))[1:]
    assert argv[1 : 1 + len(SMALL)] == SMALL
    doc, _ = _run(argv, tmp_path / "side.json", capsys)
    (r,) = doc["rounds"]
    mine, other = r["kvflow"], r["other"]
    assert not mine["failed"] and not other["failed"]
    assert mine["values"]["startup_s"] > 0 and other["values"]["startup_s"] > 0
    assert mine["values"]["burst_all_done_s"] > 0 and other["values"]["burst_all_done_s"] > 0
    at = [(mine["groups_at"][g], other["groups_at"][g]) for g in ("single", "clients", "burst")]
    assert at[0][0] < at[0][1] < at[1][1] < at[1][0] < at[2][0] < at[2][1]  # A B, B A, A B
    # the cold rows' 5 samples take turns the same way, before the rest of the group
    cold = [(mine["groups_at"][f"cold/{i}"], other["groups_at"][f"cold/{i}"]) for i in range(5)]
    turns = [x for i, (a, b) in enumerate(cold) for x in ((a, b) if i % 2 == 0 else (b, a))]
    assert turns == sorted(turns) and turns[-1] < at[0][0], (cold, at)
    for run in (mine, other):
        assert len(run["samples"]["ttft_cold_short_s"]) == 5
        assert run["values"]["ttft_cold_short_s"] == statistics.median(
            run["samples"]["ttft_cold_short_s"]
        )
    assert mine["texts"]["cold_short/4"] == other["texts"]["cold_short/4"]
    assert mine["texts"]["settle/0"] == other["texts"]["settle/0"]  # each settled, untimed
    # each server's group waited for quiet cores first, within --quiet-s (default 10 s)
    for run in (mine, other):
        assert set(run["quiet_s"]) == {
            "single",
            "clients",
            "burst",
            *(f"cold/{i}" for i in range(5)),
        }
        assert all(0 <= w < 10 + 5 for w in run["quiet_s"].values()), run["quiet_s"]
    assert r["greedy"]["identical"] == r["greedy"]["compared"] > 0


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads the host's /proc/stat")
def test_wait_quiet_waits_to_its_limit_while_the_cores_are_busy() -> None:
    """Against the host's own /proc/stat: a spinning process on every core keeps it waiting
    to the limit; a limit of 0 does not wait."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    started = [ctx.Event() for _ in range(os.cpu_count() or 1)]
    busy = [ctx.Process(target=_spin, args=(e,), daemon=True) for e in started]
    for p in busy:
        p.start()
    try:
        assert all(e.wait(120) for e in started)  # every one spinning before the wait starts
        assert side.wait_quiet(1.5) >= 1.5
    finally:
        for p in busy:
            p.kill()
            p.join()
    assert side.wait_quiet(0) < 0.1


def _spin(started: Any) -> None:
    started.set()
    while True:
        pass
