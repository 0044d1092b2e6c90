"""The mixed-load benchmark's engine mode runs, with its one summary line and --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.stages.engine import write_demo_model
from kvflow.tools.bench import mixed


def test_engine_mode_measures_tbt_during_a_long_prefill(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "mixed.json"
    argv = ["--engine", "--model", str(model), "--streams", "2", "--stream-words", "4"]
    argv += ["--stream-tokens", "200", "--warm-tokens", "2", "--long-tokens", "300"]
    argv += ["--variant", "mixed=mixed:on chunk:64", "--variant", "separate=mixed:off chunk:64"]
    argv += ["--json", str(out)]
    assert mixed.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("mixed: mixed: long TTFT")
    doc = json.loads(out.read_text())
    for name in ("mixed", "separate"):
        runs = doc["runs"][name]
        assert len(runs) == 2  # A B B A
        for r in runs:
            # 300 tokens in chunks of 64: 5 steps, each with the streams' tokens
            assert r["tokens_during"] == 5 * 2
            assert 0 < r["tbt_during_p50_s"] <= r["tbt_during_max_s"] <= r["long_ttft_s"]
    assert doc["meta"]["load_avg"]


@pytest.mark.slow
def test_server_mode_measures_a_real_embedded_server(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default mode starts `kvflow serve` processes and streams over their HTTP API."""
    out = tmp_path / "mixed.json"
    argv = ["--model", str(tiny_model), "--streams", "2", "--stream-words", "4"]
    argv += ["--stream-tokens", "40", "--warm-tokens", "2", "--long-words", "200"]
    argv += ["--rounds", "1", "--variant", "disagg=", "--json", str(out)]
    assert mixed.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("mixed: disagg: long TTFT")
    run = json.loads(out.read_text())["runs"]["disagg"][0]
    assert run["long_prompt_tokens"] > 100
    assert run["long_ttft_s"] > 0
