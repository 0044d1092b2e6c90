"""The roofline benchmark runs end to end and writes its JSON; the docs' command runs as
written on the default model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvflow.stages.engine import EngineConfig, write_demo_model
from kvflow.tools.bench import roofline
from tests.docs.blocks import block
from tests.docs.shell import run_bash


def test_roofline_quick_two_dtypes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "roofline.json"
    argv = ["--quick", "--fused", "--dtype", "float32,bfloat16", "--model", str(model)]
    assert roofline.main([*argv, "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_roofline tiny: read ")
    doc = json.loads(out.read_text())
    assert doc["bandwidth"] > 0
    assert set(doc["runs"]) == {"fused-float32", "fused-bfloat16"}
    for name, run in doc["runs"].items():
        assert run["dtype"] == name.split("-")[1]
        pre = run["prefill"][0]
        assert pre["tokens"] == pre["mm_rows"] == 64 and pre["mm_flops"] > 0
        assert pre["matmul_share"] == pytest.approx(pre["flops"] / pre["mm_flops"])
        b1 = run["decode"][0]
        assert b1["batch"] == 1 and b1["tok_s"] > 0 and b1["ceiling_share"] > 0
    # bf16 weights are half the bytes, so the bandwidth ceiling doubles.
    f32, b16 = doc["runs"]["fused-float32"], doc["runs"]["fused-bfloat16"]
    assert f32["weight_bytes"] == 2 * b16["weight_bytes"]
    assert doc["meta"]["threads"] == 2


def test_roofline_quick_two_linear_backends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVFLOW_LINEAR", raising=False)
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "roofline.json"
    argv = ["--quick", "--linears", "gemv,onednn,aten", "--model", str(model), "--json", str(out)]
    assert roofline.main(argv) == 0
    assert capsys.readouterr().out.count("fused-float32-") == 3
    doc = json.loads(out.read_text())
    names = {"fused-float32-gemv", "fused-float32-onednn", "fused-float32-aten"}
    assert set(doc["runs"]) == names
    gemv, one = doc["runs"]["fused-float32-gemv"], doc["runs"]["fused-float32-onednn"]
    aten = doc["runs"]["fused-float32-aten"]
    # the same weights, no copy
    assert gemv["weight_bytes"] == one["weight_bytes"] == aten["weight_bytes"] > 0
    assert all(r["decode"][0]["tok_s"] > 0 for r in (gemv, one, aten))
    assert "KVFLOW_LINEAR" not in os.environ  # restored after each engine
    with pytest.raises(SystemExit):
        roofline.main(["--linears", "onednn,mkl"])
    assert "unknown linear backend(s) ['mkl']" in capsys.readouterr().err


@pytest.mark.slow
def test_docs_kernel_isa_block(tmp_path: Path) -> None:
    """The roofline with the kernels built for plain loops (`KVFLOW_KERNEL_ISA=generic`)."""
    run_bash(block("performance.md", "performance-kernel-isa"), tmp_path)
    doc = json.loads((tmp_path / "roofline-generic.json").read_text())
    assert doc["summary"].startswith("bench_roofline SmolLM2-135M-Instruct")


@pytest.mark.slow
def test_docs_linears_ab_block(tmp_path: Path) -> None:
    """The two prefill copies side by side on the default model (`--linears prepacked,
    transposed`): each engine keeps its copy in its own form, the same weights."""
    run_bash(block("performance.md", "performance-linears-ab"), tmp_path)
    doc = json.loads((tmp_path / "roofline-linears.json").read_text())
    assert set(doc["runs"]) == {"fused-float32-prepacked", "fused-float32-transposed"}
    assert all(r["decode"][0]["tok_s"] > 0 for r in doc["runs"].values())


@pytest.mark.slow
def test_docs_panel_ab_block(tmp_path: Path) -> None:
    """The prepacked and the panel copies side by side on the default model (`--linears
    prepacked,panel`), the same weights."""
    run_bash(block("performance.md", "performance-panel-ab"), tmp_path)
    doc = json.loads((tmp_path / "roofline-panel.json").read_text())
    assert set(doc["runs"]) == {"fused-float32-prepacked", "fused-float32-panel"}
    assert all(r["decode"][0]["tok_s"] > 0 for r in doc["runs"].values())
    assert all(r["prefill"][0]["tok_s"] > 0 for r in doc["runs"].values())


def test_roofline_rejects_an_unknown_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        roofline.main(["--dtype", "float32,int3"])
    assert "unknown dtype(s) ['int3']" in capsys.readouterr().err


@pytest.mark.slow
def test_docs_roofline_block(tmp_path: Path) -> None:
    run_bash(block("performance.md", "performance-roofline"), tmp_path)
    doc = json.loads((tmp_path / "roofline.json").read_text())
    assert doc["summary"].startswith("bench_roofline SmolLM2-135M-Instruct")


def test_roofline_quick_quantized(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "roofline.json"
    argv = ["--quick", "--dtype", "bfloat16,int8,int4", "--model", str(model)]
    assert roofline.main([*argv, "--json", str(out)]) == 0
    assert capsys.readouterr().out.count("fused-int4: p64=") == 1
    runs = json.loads(out.read_text())["runs"]
    assert all(r["decode"][0]["ceiling_share"] > 0 for r in runs.values())
    # The decoder's linears shrink (int8: 1 byte per weight + a scale per row; int4: half a
    # byte + a scale and zero per 32), the tied bf16 embedding table does not.
    b16, i8, i4 = (runs[f"fused-{d}"]["weight_bytes"] for d in ("bfloat16", "int8", "int4"))
    assert b16 > i8 > i4 > 0


def test_roofline_quick_elementwise_fused_and_torch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLOW_FUSED", "1")
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "roofline.json"
    argv = ["--quick", "--elementwise", "fused,torch", "--model", str(model), "--json", str(out)]
    assert roofline.main(argv) == 0
    assert capsys.readouterr().out.count("fused-float32-") == 2
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"fused-float32-fused", "fused-float32-torch"}
    assert all(r["decode"][0]["tok_s"] > 0 for r in doc["runs"].values())
    assert os.environ["KVFLOW_FUSED"] == "1"  # restored after each run
    with pytest.raises(SystemExit):
        roofline.main(["--elementwise", "fused,numpy"])


def test_roofline_quick_attention_paged_and_torch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVFLOW_ATTN", raising=False)
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "roofline.json"
    argv = ["--quick", "--attention", "paged,torch", "--model", str(model), "--json", str(out)]
    assert roofline.main(argv) == 0
    assert capsys.readouterr().out.count("fused-float32-") == 2
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"fused-float32-paged", "fused-float32-torch"}
    assert all(r["decode"][1]["tok_s"] > 0 for r in doc["runs"].values())
    assert "KVFLOW_ATTN" not in os.environ  # restored after each run
    with pytest.raises(SystemExit):
        roofline.main(["--attention", "paged,flash"])


def test_decode_rate_of_a_batch_whose_prompts_outlast_the_timed_steps(tmp_path: Path) -> None:
    """The first prompts decode while the last ones prefill (several steps of 64 tokens
    here): each request's token budget covers that, every request is still running when the
    timed steps start, and all are gone after."""
    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    config = EngineConfig(num_pages=64, max_batch=8, prefill_chunk=64)
    engine = roofline.open_engine(model, config, fuse=True)
    assert roofline.decode_tokens(8, 40, 2, 64) > 2 + 5  # 5 steps of prompts, 1 a prompt
    assert roofline.decode_tok_s(engine, batch=8, context=40, steps=2, seed=0) > 0
    assert not engine.has_unfinished() and engine.num_free_pages == 64
