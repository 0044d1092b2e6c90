"""The model benchmark runs end to end (tiny demo model) and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.stages.engine import write_demo_model
from kvflow.tools.bench import model as bench_model


def test_bench_model_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "bench.json"
    argv = ["--quick", "--model", str(model), "--detok-tokens", "256", "--json", str(out)]
    assert bench_model.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_model tiny: detokenize 256 tokens")
    doc = json.loads(out.read_text())
    assert doc["detokenize"]["tokens"] == 256 and doc["detokenize"]["plain_ms"] > 0
    speed = doc["speed"]
    assert speed["prefill_tokens"] == 64 and speed["decode_speed_ratio"] > 0
    assert doc["meta"]["threads"] == 2
