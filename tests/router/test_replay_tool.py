"""`kvflow replay` on the trace slice (its own parser, so it needs no other command module)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvflow.tools import replay

SLICE = Path(__file__).parent / "data" / "mooncake_slice_3600_3900.jsonl"


def invoke(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    replay.register(parser.add_subparsers())
    args = parser.parse_args(["replay", *argv])
    return int(args.func(args))


def test_table_for_all_policies(capsys, tmp_path):
    out_path = tmp_path / "r.json"
    code = invoke("--trace", str(SLICE), "--limit", "60", "--all-policies", "--json", str(out_path))
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("60 requests, 8 prefill + 4 decode instances; costs: llama3-70b")
    assert lines[1] == replay.HEADER
    assert [line.split()[0] for line in lines[2:]] == [
        "cache-aware", "local-cache-aware", "random", "round-robin", "least-loaded",
    ]  # fmt: skip
    doc = json.loads(out_path.read_text())
    assert doc["reports"][0]["policy"] == "cache-aware"
    assert doc["records"] == 60


def test_json_to_stdout(capsys):
    assert invoke("--trace", str(SLICE), "--limit", "20", "--policy", "random", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in doc["reports"]] == ["random"]
    assert doc["reports"][0]["num_requests"] == 20


def test_bad_input_is_reported(capsys, tmp_path):
    assert invoke("--trace", str(tmp_path / "missing.jsonl")) == 2
    assert "kvflow replay:" in capsys.readouterr().err
    assert invoke("--trace", str(SLICE), "--prefill", "0") == 2
    assert "num_prefill" in capsys.readouterr().err


def test_sweep_writes_plots_and_requests_csv(capsys, tmp_path):
    plots, csv_path = tmp_path / "plots", tmp_path / "requests.csv"
    code = invoke(
        "--trace", str(SLICE), "--limit", "80", "--policy", "cache-aware,random",
        "--load", "1,3", "--ttft-slo", "10", "--tbt-slo", "0.1",
        "--plots", str(plots), "--requests-csv", str(csv_path),
    )  # fmt: skip
    assert code == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [(r.split()[0], r.split()[1]) for r in rows] == [
        ("cache-aware", "1"), ("cache-aware", "3"), ("random", "1"), ("random", "3"),
    ]  # fmt: skip
    names = sorted(p.name for p in plots.iterdir())
    assert names == [
        "capacity_vs_load.png", "hit_ratio_over_time.png", "per_instance_load.png",
        "ttft_cdf.png",
    ]  # fmt: skip
    for png in plots.iterdir():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
    lines = csv_path.read_text().splitlines()
    assert lines[0].startswith("policy,load,prefill,decode,cache,request_id,")
    assert len(lines) == 1 + 4 * 80


def test_unbounded_cache_and_units_in_help(capsys):
    assert invoke("--trace", str(SLICE), "--limit", "30", "--cache-blocks", "0") == 0
    parser = argparse.ArgumentParser()
    replay.register(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["replay"]  # type: ignore[union-attr]
    text = " ".join(sub.format_help().split())  # argparse wraps lines
    assert "BLOCKS of --block-size tokens" in text and "TOKENS" in text and "BYTES/s" in text
