"""The decode step's folded small ops compute the same numbers as the forms they replace:
RoPE by roll and a signed sin (q and k rotated as one block) equals transformers' rotate-half
form bit for bit, and float32 RMSNorm by `F.rms_norm` equals the explicit float32 formula."""

from __future__ import annotations

import pytest
import torch

from kvflow.stages.engine.model import RMSNorm
from kvflow.stages.engine.rope import Rotary, apply_rotary
from kvflow.stages.engine.spec import RopeSpec


def _rotate_half_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """transformers' apply_rotary_pos_emb for one tensor [T, heads, d]."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_rotate_half_bit_for_bit(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    rotary = Rotary(RopeSpec(theta=10000.0), 64, torch.device("cpu"))
    positions = torch.tensor([0, 1, 7, 300, 4095])
    x = torch.randn(5, 12, 64, generator=gen).to(dtype)
    cos, signed_sin = rotary.cos_sin(positions, dtype)
    got = apply_rotary(x, cos, signed_sin)
    want = _rotate_half_reference(x, positions, rotary.inv_freq)
    assert got.dtype == dtype and torch.equal(got, want)
    # q and k as one block (the fused projection's first columns) == each on its own
    q, k = x[:, :9], x[:, 9:]
    assert torch.equal(got[:, :9], apply_rotary(q, cos, signed_sin))
    assert torch.equal(got[:, 9:], apply_rotary(k, cos, signed_sin))


def test_float32_rmsnorm_equals_the_explicit_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    for rows in (1, 8, 512):
        x = torch.randn(rows, 576, generator=gen) * 3
        want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        assert torch.equal(norm(x), want)
