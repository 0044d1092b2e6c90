"""Rotary position embeddings (RoPE), including linear and llama3-style frequency scaling.

Frequencies and angles are computed in float32 exactly as transformers does, then cast to the
activation dtype, so fp32 logits match transformers to ~1e-6.
"""

from __future__ import annotations

import math

import torch

from kvflow.stages.engine.spec import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies for `rope`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary:
    """Computes cos/sin for positions and applies the rotation. Stateless after init."""

    def __init__(self, rope: RopeSpec, head_dim: int, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] -> (cos, signed sin), each [T, 1, head_dim] in `dtype`; the
        signed sin is the sin with its first half negated (what `apply_rotary` takes)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : sin.shape[-1] // 2].neg_()
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by (cos, signed sin) [T, 1, head_dim] (`Rotary.cos_sin`);
    returns a new tensor.

    Transformers computes x * cos + cat(-x2, x1) * sin (x1, x2 the halves of x); here
    roll(x) = cat(x2, x1) times the sin whose first half is negated: the same products
    ((-a) * b == a * (-b) exactly), in 4 ops instead of 7 (two slices, a neg, a cat)."""
    out = x * cos
    return out.add_(torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin)
