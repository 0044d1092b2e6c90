"""ModelSpec: what a Hugging Face config.json describes, checked and normalised.

Supported architectures are Llama-style decoders: LlamaForCausalLM, MistralForCausalLM and
Qwen2ForCausalLM. Both the old (`rope_theta` + `rope_scaling`) and the transformers 5
(`rope_parameters`) spelling of RoPE settings are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.stages.engine.errors import ModelLoadError

ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding settings: base theta, scaling type and its parameters."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """The architecture of a loaded model (immutable; derived from config.json)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def num_params(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += h
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    @property
    def linear_params(self) -> int:
        """Weights of the decoder layers' linears (no biases, no embeddings, no lm_head): what
        a float32 copy for prefill holds (onednn_linear.py)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        return self.num_layers * (attn + 3 * h * i)


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise ModelLoadError(f"config.json has no {key!r}")
    return cfg[key]


def _rope(cfg: dict[str, Any]) -> RopeSpec:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    merged: dict[str, Any] = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(merged.get("rope_type", merged.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r} in config.json (supported: {list(ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeSpec(theta=theta)
    factor = float(_require(merged, "factor"))
    if rope_type == "linear":
        return RopeSpec(theta=theta, rope_type="linear", factor=factor)
    return RopeSpec(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(_require(merged, "low_freq_factor")),
        high_freq_factor=float(_require(merged, "high_freq_factor")),
        original_max_position_embeddings=int(_require(merged, "original_max_position_embeddings")),
    )


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    window = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        if cfg.get("use_sliding_window"):
            raise ModelLoadError("Qwen2 use_sliding_window=true is not supported")
        return None
    if arch == "MistralForCausalLM" and window is not None:
        return int(window)
    return None


def _eos(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, list):
        return tuple(int(e) for e in eos)
    return (int(eos),)


def spec_from_config(cfg: dict[str, Any]) -> ModelSpec:
    """Build a ModelSpec from a parsed config.json; raises ModelLoadError naming the problem."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs!r} in config.json (supported: {list(ARCHITECTURES)})"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"unsupported hidden_act {act!r} (only 'silu')")
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(f"num_attention_heads {heads} not a multiple of kv heads {kv_heads}")
    # Bias layout follows each architecture's transformers implementation.
    if arch == "Qwen2ForCausalLM":
        qkv_bias, o_bias = True, False
    elif arch == "LlamaForCausalLM":
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
    else:
        qkv_bias = o_bias = False
    return ModelSpec(
        architecture=arch,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size")),
        num_layers=int(_require(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window(cfg, arch),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos(cfg),
    )


def load_spec(model_dir: Path) -> tuple[ModelSpec, bytes]:
    """Read `model_dir/config.json`; returns the spec and the raw config bytes."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"model directory {model_dir} has no config.json")
    raw = path.read_bytes()
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    try:
        return spec_from_config(cfg), raw
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: bad field value: {exc}") from exc
