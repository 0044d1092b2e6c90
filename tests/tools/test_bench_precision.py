"""The precision and thread-placement benchmarks run end to end and write their JSON; the
docs' precision command runs as written on the default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.stages.engine import write_demo_model
from kvflow.tools.bench import precision, threads
from tests.docs.blocks import block
from tests.docs.shell import run_bash


def test_precision_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "precision.json"
    assert precision.main(["--quick", "--model", str(model), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_precision tiny bfloat16 vs float32")
    doc = json.loads(out.read_text())
    assert doc["prompts"] == 2 and doc["tokens_per_prompt"] == 8
    assert 0.0 <= doc["agreement"] <= 1.0 and doc["max_logit_diff"] > 0  # bf16 really ran
    assert doc["rows"][0]["prompt_tokens"] == 37  # the equivalence tests' prompt


def test_threads_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "threads.json"
    argv = ["--quick", "--threads", "2/2,1", "--model", str(model), "--json", str(out)]
    assert threads.main(argv) == 0
    assert capsys.readouterr().out.startswith("bench_threads tiny prompt 32 decode b1: ")
    rows = json.loads(out.read_text())["rows"]
    assert [r["threads"] for r in rows] == ["2/2", "1/1"]
    for r in rows:
        assert min(r["prefill_alone"], r["decode_alone"], r["prefill_busy"]) > 0
        assert r["decode_busy"] > 0


@pytest.mark.slow
def test_docs_precision_block(tmp_path: Path) -> None:
    run_bash(block("performance.md", "performance-precision"), tmp_path)
    doc = json.loads((tmp_path / "precision.json").read_text())
    assert doc["summary"].startswith("bench_precision SmolLM2-135M-Instruct bfloat16")


def test_precision_quick_quantized(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "precision.json"
    argv = ["--quick", "--dtype", "int8,int4", "--model", str(model), "--json", str(out)]
    assert precision.main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("bench_precision tiny int8 vs float32") and "| int4 vs float32" in line
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"int8", "int4"}
    assert all(r["max_logit_diff"] > 0 and r["prompts"] == 2 for r in results.values())


def test_precision_rejects_float32_and_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("float32", "int8,int3"):
        with pytest.raises(SystemExit):
            precision.main(["--dtype", bad])
    assert "unknown dtype(s) ['int3']" in capsys.readouterr().err


@pytest.mark.slow
def test_docs_quantized_precision_block(tmp_path: Path) -> None:
    run_bash(block("performance.md", "performance-quantized"), tmp_path)
    doc = json.loads((tmp_path / "precision.json").read_text())
    assert set(doc["results"]) == {"int8", "int4"}
    assert doc["summary"].startswith("bench_precision SmolLM2-135M-Instruct int8 vs float32")
