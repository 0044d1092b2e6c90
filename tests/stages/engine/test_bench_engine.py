"""The engine benchmark runs end to end on the tiny preset and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.tools.bench import engine as bench_engine


def test_bench_engine_quick(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--quick", "--model", str(tiny_dir), "--decode-steps", "2", "--json", str(out)]
    assert bench_engine.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_engine ")
    (result,) = json.loads(out.read_text())["results"]
    assert [p["tokens"] for p in result["prefill"]] == [128, 512]
    assert [r["imported"] for r in result["reuse"]] == [0, 256, 486, 448]
    assert result["reuse"][0]["fraction_of_cold"] == 1.0
    assert [d["batch"] for d in result["decode"]] == [1, 8]
    assert all(d["tok_s"] > 0 for d in result["decode"])
