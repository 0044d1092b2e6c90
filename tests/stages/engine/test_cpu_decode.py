"""A decode step's layers in one C call (cpu_decode.py) against the model's modules one by one
(KVFLOW_DECODE=0): the same logits bit for bit, step by step, for batches of requests at
different positions, with biases, tied embeddings and a sliding window; and the cases the
call must leave to the modules."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow.stages.engine import SamplingParams
from kvflow.stages.engine.cpu_decode import ENV_DECODE, DecodeLayers
from kvflow.stages.engine.cpu_fused import ENV_FUSED
from kvflow.stages.engine.cpu_gemv import MAX_ROWS
from kvflow.stages.engine.onednn_linear import ENV_LINEAR
from kvflow.stages.engine.runner import ModelRunner
from tests.stages.engine.conftest import open_engine
from tests.stages.engine.hf_models import make_hf_model

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("cc") is None,
    reason="the kernels are built on Linux with a C compiler",
)

MODELS = {
    "llama": ("llama", {}),
    "llama-tied-bias": (
        "llama",
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ),
    "mistral-sliding": ("mistral", {"sliding_window": 8, "head_dim": 32}),
    "qwen2-bias": ("qwen2", {}),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = MODELS[request.param]
    return make_hf_model(tmp_path_factory.mktemp(request.param), arch, seed=3, **overrides)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the rows of every DecodeLayers call."""
    calls: list[int] = []
    original = DecodeLayers.__call__

    def spy(self: DecodeLayers, x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return original(self, x, *args)

    monkeypatch.setattr(DecodeLayers, "__call__", spy)
    return calls


def _decode(model_dir: Path, prompts: list[list[int]], steps: int) -> dict[str, list[torch.Tensor]]:
    engine = open_engine(model_dir, prefill_chunk=16)
    sampling = SamplingParams(max_tokens=steps, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    logits: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            if out.logits is not None:
                logits[out.request_id].append(out.logits)
    return logits


@pytest.mark.parametrize("linear", ["gemv", "panel"])
def test_layers_in_one_call_equal_the_modules_bit_for_bit(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, linear: str
) -> None:
    """Three requests (3, 21 and 40 tokens: one page, several, past the sliding window)
    decoded together for 12 steps, then alone: every step's logits identical both ways, with
    the projections on the matrix-vector kernel ("gemv") and on their panel copies."""
    monkeypatch.setenv(ENV_LINEAR, linear)
    prompts = [[(7 * i + 3 * r) % 200 + 5 for i in range(n)] for r, n in enumerate((3, 21, 40))]
    calls = _counting(monkeypatch)
    runs, seen = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv(ENV_DECODE, flag)
        calls.clear()
        runs[flag] = _decode(model_dir, prompts, 12) | {
            "alone": _decode(model_dir, prompts[1:2], 5)["r0"]
        }
        seen[flag] = list(calls)
    assert seen["0"] == []
    assert 3 in seen["1"] and 1 in seen["1"]  # a batch of three and a request alone
    for key, steps in runs["1"].items():
        assert len(steps) == len(runs["0"][key]) > 1
        for a, b in zip(steps, runs["0"][key], strict=True):
            assert torch.equal(a, b), key


def test_panels_take_a_decode_batch_past_the_matrix_vector_kernels_rows(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every projection on a panel copy the call takes any decode batch: 20 requests
    decoding together (more rows than `MAX_ROWS`), the same logits bit for bit as the
    modules'."""
    monkeypatch.setenv(ENV_LINEAR, "panel")
    prompts = [[(5 * i + 3 * r) % 200 + 5 for i in range(3)] for r in range(MAX_ROWS + 4)]
    calls = _counting(monkeypatch)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(ENV_DECODE, flag)
        calls.clear()
        runs[flag] = _decode(llama_dir, prompts, 8)
        if flag == "1":
            assert max(calls) > MAX_ROWS, calls
    assert calls == []
    for key, steps in runs["1"].items():
        assert len(steps) == len(runs["0"][key]) == 8
        for a, b in zip(steps, runs["0"][key], strict=True):
            assert torch.equal(a, b), key


def test_the_modules_run_where_the_call_does_not_apply(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the fused elementwise kernels, with torch's attention, or with more rows than
    the matrix-vector kernel takes (KVFLOW_LINEAR=gemv: no panel copy), decode steps run the
    modules (and still decode)."""
    monkeypatch.setenv(ENV_LINEAR, "gemv")
    calls = _counting(monkeypatch)
    prompts = [[(5 * i + r) % 200 + 5 for i in range(6)] for r in range(17)]
    for env, value in ((ENV_FUSED, "0"), ("KVFLOW_ATTN", "torch")):
        with monkeypatch.context() as m:
            m.setenv(env, value)
            logits = _decode(llama_dir, prompts[:3], 3)
        assert all(len(steps) == 3 for steps in logits.values())
        assert calls == [], env
    batches: list[int] = []
    decode = ModelRunner.decode

    def spy(self: ModelRunner, seqs: Any) -> torch.Tensor:
        batches.append(len(seqs))
        return decode(self, seqs)

    monkeypatch.setattr(ModelRunner, "decode", spy)
    logits = _decode(llama_dir, prompts, 12)
    assert all(len(steps) == 12 for steps in logits.values())
    assert MAX_ROWS + 1 in batches and max(calls) <= MAX_ROWS  # 17 rows: the modules
    calls.clear()
    _decode(llama_dir, prompts[:MAX_ROWS], 12)
    assert max(calls) == MAX_ROWS


def test_an_unknown_setting_fails_at_load(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DECODE, "yes")
    with pytest.raises(ValueError, match=ENV_DECODE):
        open_engine(tiny_dir)
