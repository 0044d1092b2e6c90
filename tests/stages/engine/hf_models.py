"""Tiny models created and saved by Hugging Face transformers, for equivalence tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvflow.stages.engine.demo import build_tokenizer

BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make_hf_model(
    out: Path, arch: str, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """Create a random `arch` model with transformers (seeded), save it with safetensors to
    `out` (sharded when max_shard_size is given) plus a byte-level tokenizer.json."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[arch]
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }[arch]
    config = config_cls(**{**BASE, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # make norms and biases non-trivial so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    build_tokenizer().save(str(out / "tokenizer.json"))
    return out


def hf_logits(model_dir: Path, arch: str, token_ids: list[int], steps: int) -> list[torch.Tensor]:
    """transformers' fp32 logits: [prefill last-token logits, then one per greedy decode step]
    using its own KV cache. Returns steps + 1 tensors of shape [vocab]."""
    import transformers

    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }[arch]
    model = model_cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    out: list[torch.Tensor] = []
    with torch.no_grad():
        res = model(torch.tensor([token_ids]), use_cache=True)
        cache = res.past_key_values
        logits = res.logits[0, -1].float()
        out.append(logits)
        for _ in range(steps):
            nxt = int(logits.argmax())
            res = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            logits = res.logits[0, -1].float()
            out.append(logits)
    return out
