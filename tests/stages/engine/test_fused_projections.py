"""Fusing q/k/v and gate/up at load time changes no output: the fused model's greedy tokens
equal the unfused one's and its logits agree to float32 rounding; the HF names still load."""

from __future__ import annotations

from pathlib import Path

import torch

from kvflow.stages.engine import EngineConfig, SamplingParams
from kvflow.stages.engine.loader import load_weights
from kvflow.stages.engine.spec import load_spec
from kvflow.tools.bench.roofline import open_engine


def _generate(model_dir: Path, fuse: bool) -> tuple[list[int], list[torch.Tensor]]:
    config = EngineConfig(block_size=8, num_pages=64, prefill_chunk=16, return_logits=True)
    engine = open_engine(model_dir, config, fuse)
    engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=12, ignore_eos=True))
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if out.logits is not None:
                logits.append(out.logits)
    return tokens, logits


def test_fused_equals_unfused(llama_dir: Path) -> None:
    fused_tokens, fused_logits = _generate(llama_dir, fuse=True)
    plain_tokens, plain_logits = _generate(llama_dir, fuse=False)
    assert len(fused_tokens) == 12 and fused_tokens == plain_tokens
    for a, b in zip(fused_logits, plain_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_layout_replaces_the_separate_weights(llama_dir: Path) -> None:
    spec, _ = load_spec(llama_dir)
    model = load_weights(llama_dir, spec, torch.float32, torch.device("cpu"), fuse=True)
    names = set(dict(model.named_parameters()))
    attn = "model.layers.0.self_attn."
    mlp = "model.layers.0.mlp."
    assert {attn + "qkv_proj.weight", mlp + "gate_up_proj.weight"} <= names
    assert not any(
        n.endswith((".q_proj.weight", ".gate_proj.weight", ".up_proj.weight")) for n in names
    )
    plain = load_weights(llama_dir, spec, torch.float32, torch.device("cpu"), fuse=False)
    layer = plain.model.layers[0]
    expected = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight, expected)
