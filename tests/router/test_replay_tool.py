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
    assert lines[0] == "60 requests, 8 prefill + 4 decode instances"
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
