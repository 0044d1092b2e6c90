"""Decode attention of a batch of one request (`PagedDecode._single`: no mask, no gather
within one page) equals the masked reference and that request's row in a larger batch.
These test torch's path (`KVFLOW_ATTN=torch`); the CPU kernel's: test_cpu_attn.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.stages.engine.attention import PagedDecode
from kvflow.stages.engine.cpu_attn import ENV_ATTN
from kvflow.stages.engine.pages import KVLayout, PagePool

BS, KVH, HEADS, D = 8, 2, 6, 16


@pytest.fixture(autouse=True)
def _torch_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_ATTN, "torch")


def _pool() -> PagePool:
    layout = KVLayout(num_layers=2, num_kv_heads=KVH, head_dim=D, block_size=BS, dtype="float32")
    pool = PagePool(12, layout, torch.float32, torch.device("cpu"))
    pool.tensor.normal_(generator=torch.Generator().manual_seed(3))  # earlier tokens' K/V
    return pool


def _reference(
    pool: PagePool, pages: list[int], pos: int, q: torch.Tensor, window: int | None
) -> torch.Tensor:
    """q [HEADS, D] over the request's slots [0, pos] (a window hides j <= pos - window),
    read from the pool slot by slot: [HEADS * D]."""
    kv = torch.stack([pool.tensor[pages[j // BS], 1, :, :, j % BS] for j in range(pos + 1)])
    keys = torch.arange(pos + 1)
    mask = keys > (pos - window) if window is not None else keys >= 0
    out = F.scaled_dot_product_attention(
        q[None, :, None],
        kv[:, 0].transpose(0, 1)[None],
        kv[:, 1].transpose(0, 1)[None],
        attn_mask=mask[None],
        enable_gqa=True,
    )
    return out.reshape(-1)


@pytest.mark.parametrize("pos", [0, 5, 7, 8, 29])  # first slot, in a page, page ends, 4 pages
@pytest.mark.parametrize("window", [None, 64])
def test_single_request_equals_masked_and_its_batch_row(pos: int, window: int | None) -> None:
    pool = _pool()
    pages, other = [9, 2, 11, 4], [0, 6, 1, 3]
    n = pos // BS + 1
    gen = torch.Generator().manual_seed(pos)
    q, k, v = (torch.randn(2, h, D, generator=gen) for h in (HEADS, KVH, KVH))
    single = PagedDecode(pool, torch.tensor([pages[:n]]), torch.tensor([pos]), window)
    assert single.single is not None
    got = single.attend(1, q[:1], k[:1], v[:1])
    # the new token's K/V went into its slot, and nowhere else of the layer's page
    assert torch.equal(pool.tensor[pages[n - 1], 1, 0, :, pos % BS], k[0])
    assert torch.equal(pool.tensor[pages[n - 1], 1, 1, :, pos % BS], v[0])
    want = _reference(pool, pages, pos, q[0], window)
    assert float((got[0] - want).abs().max()) < 1e-5
    # the same request beside another (the masked batch path) answers the same
    table = torch.tensor([pages[:n], other[:n]])
    batch = PagedDecode(pool, table, torch.tensor([pos, max(pos - 3, 0)]), window)
    assert batch.single is None
    both = batch.attend(1, q, k, v)
    assert float((both[0] - got[0]).abs().max()) < 1e-5


def test_single_request_under_a_window_that_hides_tokens_stays_masked() -> None:
    pool = _pool()
    pages, pos, window = [9, 2, 11], 20, 6
    decode = PagedDecode(pool, torch.tensor([pages]), torch.tensor([pos]), window)
    assert decode.single is None
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, D, generator=gen) for h in (HEADS, KVH, KVH))
    got = decode.attend(1, q, k, v)
    assert float((got[0] - _reference(pool, pages, pos, q[0], window)).abs().max()) < 1e-5
