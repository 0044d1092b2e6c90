"""The roofline benchmark runs end to end and writes its JSON; the docs' command runs as
written on the default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.stages.engine import write_demo_model
from kvflow.tools.bench import roofline
from tests.docs.blocks import block
from tests.docs.shell import run_bash


def test_roofline_quick_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "roofline.json"
    assert roofline.main(["--quick", "--compare", "--model", str(model), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_roofline tiny: mm ")
    doc = json.loads(out.read_text())
    assert doc["machine"]["mm"] > 0 and doc["machine"]["bw"] > 0
    assert set(doc["runs"]) == {"fused", "unfused"}
    for run in doc["runs"].values():
        assert run["prefill"][0]["tokens"] == 64 and run["prefill"][0]["matmul_share"] > 0
        b1 = run["decode"][0]
        assert b1["batch"] == 1 and b1["tok_s"] > 0 and b1["ceiling_share"] > 0
    assert doc["meta"]["threads"] == 2


@pytest.mark.slow
def test_docs_roofline_block(tmp_path: Path) -> None:
    run_bash(block("performance.md", "performance-roofline"), tmp_path)
    doc = json.loads((tmp_path / "roofline.json").read_text())
    assert doc["summary"].startswith("bench_roofline SmolLM2-135M-Instruct")
