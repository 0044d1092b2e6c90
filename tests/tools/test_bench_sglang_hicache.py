"""bench_sglang_hicache: one summary line, --json with both paths per layout (tiny sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.tools.bench import sglang_hicache


def test_tiny_run_prints_one_line_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "b.json"
    args = ["--pages", "3", "--page-size", "4", "--layers", "2", "--heads", "2"]
    assert sglang_hicache.main([*args, "--head-dim", "8", "--repeat", "2", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "page_first" in lines[0] and "layer_first" in lines[0]
    data = json.loads(out.read_text())
    assert [r["layout"] for r in data["results"]] == ["page_first", "layer_first"]
    for r in data["results"]:
        assert len(r["rounds"]) == 2
        for key in ("backup", "prefetch"):
            assert r[f"{key}_zero_copy_gbps"] > 0 and r[f"{key}_generic_gbps"] > 0
            assert r[f"{key}_ratio"] > 0
