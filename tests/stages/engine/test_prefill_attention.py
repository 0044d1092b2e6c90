"""Prefill attention in query blocks, each in two parts (earlier tokens + its own) merged by
log-sum-exp, equals one masked attention over the whole context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

from kvflow.stages.engine.attention import (
    PagedPrefill,
    attend_in_parts,
    blocked_causal,
    gather_context,
    parts_apply,
)
from kvflow.stages.engine.pages import KVLayout, PagePool


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [T, H, d], k/v [start + T, kvh, d] -> [H, T, d]: one masked attention."""
    t = q.shape[0]
    mask = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)[0]


@pytest.mark.skipif(not parts_apply(torch.device("cpu"), None, 1), reason="no flash CPU op")
@pytest.mark.parametrize(
    ("start", "t", "heads", "kvh"), [(48, 16, 9, 3), (5, 3, 4, 4), (64, 1, 6, 2)]
)
def test_parts_equal_one_masked_attention(start: int, t: int, heads: int, kvh: int) -> None:
    gen = torch.Generator().manual_seed(start + t)
    q = torch.randn(t, heads, 32, generator=gen)
    k = torch.randn(start + t, kvh, 32, generator=gen)
    v = torch.randn(start + t, kvh, 32, generator=gen)
    got = attend_in_parts(
        *(x.transpose(0, 1) for x in (q, k[start:], v[start:], k[:start], v[:start]))
    )
    assert float((got - _masked(q, k, v, start)).abs().max()) < 1e-5


@pytest.mark.skipif(not parts_apply(torch.device("cpu"), None, 1), reason="no flash CPU op")
@pytest.mark.parametrize(
    ("start", "t", "block"), [(0, 50, 16), (0, 16, 16), (21, 37, 8), (64, 5, 16)]
)
def test_blocked_causal_equals_one_masked_attention(start: int, t: int, block: int) -> None:
    """Blocks that start at 0, at an earlier chunk's end, inside a page; a last block shorter
    than the others."""
    gen = torch.Generator().manual_seed(start * 100 + t)
    q = torch.randn(t, 6, 32, generator=gen)
    k = torch.randn(start + t, 2, 32, generator=gen)
    v = torch.randn(start + t, 2, 32, generator=gen)
    got = blocked_causal(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), start, block)
    assert float((got - _masked(q, k, v, start)).abs().max()) < 1e-5


@pytest.mark.skipif(not parts_apply(torch.device("cpu"), None, 1), reason="no flash CPU op")
def test_blocked_causal_keeps_bf16() -> None:
    """The merge is computed in float32 (the log-sum-exp is), the answer is in q's dtype: a
    bf16 model's next linear must get bf16."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, 4, 32, generator=gen) for n in (20, 60, 60))
    got = blocked_causal(*(x.transpose(0, 1).to(torch.bfloat16) for x in (q, k, v)), 40, 8)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - _masked(q, k, v, 40)).abs().max()) < 5e-2


def test_parts_only_without_a_window_that_hides_earlier_tokens() -> None:
    cpu = torch.device("cpu")
    assert not parts_apply(cpu, 8, 32)
    assert not parts_apply(torch.device("meta"), None, 32)
    if parts_apply(cpu, None, 32):
        assert parts_apply(cpu, 64, 32)


def test_paged_prefill_chunks_equal_masked() -> None:
    """Through the page pool: a first chunk of 40 tokens and a chunk at offset 40 (pages out of
    order, the offset inside a page) write their K/V and attend like the masked reference."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype="float32")
    pool = PagePool(16, layout, torch.float32, torch.device("cpu"))
    pages = torch.tensor([9, 2, 14, 0, 5, 11, 7])
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(52, 2, 16, generator=gen)
    v = torch.randn(52, 2, 16, generator=gen)
    q = torch.randn(12, 6, 16, generator=gen)
    q0 = torch.randn(40, 6, 16, generator=gen)
    first = PagedPrefill(pool, pages, 0, 40, None).attend(1, q0, k[:40], v[:40])
    want0 = _masked(q0, k[:40], v[:40], 0).transpose(0, 1).reshape(40, -1)
    assert float((first - want0).abs().max()) < 1e-5
    later = PagedPrefill(pool, pages, 40, 12, None)
    got = later.attend(1, q, k[40:], v[40:])
    want = _masked(q, k, v, 40).transpose(0, 1).reshape(12, -1)
    assert float((got - want).abs().max()) < 1e-5


def test_paged_prefill_lower_right_bias_equals_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the blocked parts do not apply (a GPU), a later chunk attends with torch's
    lower-right causal bias instead of a materialized mask: same answer, grouped heads too."""
    import kvflow.stages.engine.attention as attention

    monkeypatch.setattr(attention, "parts_apply", lambda *_: False)
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, block_size=8, dtype="float32")
    pool = PagePool(8, layout, torch.float32, torch.device("cpu"))
    pages = torch.tensor([3, 6, 1, 4])
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(29, 2, 16, generator=gen), torch.randn(29, 2, 16, generator=gen)
    q = torch.randn(9, 6, 16, generator=gen)
    PagedPrefill(pool, pages, 0, 20, None).attend(0, torch.randn(20, 6, 16), k[:20], v[:20])
    later = PagedPrefill(pool, pages, 20, 9, None)
    assert isinstance(later.mask, CausalBias)
    got = later.attend(0, q, k[20:], v[20:])
    want = _masked(q, k, v, 20).transpose(0, 1).reshape(9, -1)
    assert float((got - want).abs().max()) < 1e-5
    # a window that hides earlier tokens keeps the materialized mask
    windowed = PagedPrefill(pool, pages, 20, 9, 4).mask
    assert isinstance(windowed, torch.Tensor) and not isinstance(windowed, CausalBias)


def test_gather_context_is_the_pages_in_order() -> None:
    """The gathered context of one request ([pages]) and of a decode batch ([B, pages]) is,
    per k/v and head, the pages' slots concatenated in the order given (ids out of order and
    repeated, as a padded page table has them)."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn((9, 3, 2, 2, 4, 5), generator=gen)  # [pages, layers, 2, kvh, bs, d]
    ids = torch.tensor([7, 2, 5, 2])
    ctx = gather_context(pool, 1, ids)
    assert ctx.shape == (2, 2, 16, 5)
    want = torch.cat([pool[p, 1] for p in ids.tolist()], dim=2)  # [2, kvh, 4 * bs, d]
    assert torch.equal(ctx, want)
    table = torch.tensor([[7, 2, 5], [0, 8, 8]])
    batch = gather_context(pool, 2, table)
    assert batch.shape == (2, 2, 2, 12, 5)
    for b in range(2):
        want = torch.cat([pool[p, 2] for p in table[b].tolist()], dim=2)
        assert torch.equal(batch[:, b], want)
