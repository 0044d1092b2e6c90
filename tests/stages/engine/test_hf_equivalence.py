"""Logits match Hugging Face transformers for models transformers itself created and saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow.stages.engine import SamplingParams
from tests.stages.engine.conftest import open_engine
from tests.stages.engine.hf_models import hf_logits, make_hf_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500.0,
}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied-bias": (
        "llama",
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "mistral-sliding": ("mistral", {"sliding_window": 8, "head_dim": 32}),
    "qwen2-bias": ("qwen2", {}),
}


def _engine_logits(
    model_dir: Path, tokens: list[int], steps: int, **cfg: Any
) -> list[torch.Tensor]:
    engine = open_engine(model_dir, **cfg)
    engine.add_request("r", tokens, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    logits: list[torch.Tensor] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.logits is not None:
                logits.append(out.logits[0])
    return logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path: Path, case: str) -> None:
    arch, overrides = CASES[case]
    model_dir = make_hf_model(tmp_path, arch, seed=3, **overrides)
    tokens = [
        int(t) for t in torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(5))
    ]
    expected = hf_logits(model_dir, arch, tokens, steps=5)
    got = _engine_logits(model_dir, tokens, steps=5, prefill_chunk=16)
    assert len(got) == len(expected) == 6
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        diff = float((a - b).abs().max())
        assert diff <= 1e-4, f"{case} step {step}: max abs diff {diff}"


def test_sharded_checkpoint_loads_and_matches(tmp_path: Path) -> None:
    model_dir = make_hf_model(tmp_path, "llama", seed=4, max_shard_size="40KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(list(model_dir.glob("model-*.safetensors"))) > 1
    tokens = list(range(3, 30))
    expected = hf_logits(model_dir, "llama", tokens, steps=2)
    got = _engine_logits(model_dir, tokens, steps=2)
    for a, b in zip(got, expected, strict=True):
        assert float((a - b).abs().max()) <= 1e-4


def test_spec_reads_llama3_rope(tmp_path: Path) -> None:
    model_dir = make_hf_model(tmp_path, "llama", rope_parameters=LLAMA3_ROPE)
    engine = open_engine(model_dir)
    assert engine.spec.rope.rope_type == "llama3"
    assert engine.spec.rope.factor == 8.0
    assert engine.spec.rope.theta == 500.0
