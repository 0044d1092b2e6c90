"""The paged prefill attention kernel (cpu_prefill.c, `PagedKernel.prefill`) against a float64
reference over the pool read slot by slot (with the chunk's K/V written by the kernel: the
pool bit for bit as torch's index_put leaves it), and `PagedPrefill` with it against torch's path
(`KVFLOW_ATTN=torch`): chunks from position 0 and later, lengths that are not multiples of a
work item's positions, pages of odd sizes crossed, grouped-query heads, head dims that are
not multiples of 16, strided queries, 1 and 2 threads; windows and too many query heads a
KV head left to torch; and the builds without AVX-512 (AVX2, plain loops) to the same answer."""

from __future__ import annotations

import math
import platform
import shutil
import sys
from pathlib import Path

import pytest
import torch

from kvflow.stages.engine import SamplingParams, cpu_kernels
from kvflow.stages.engine.attention import PagedPrefill
from kvflow.stages.engine.cpu_attn import ENV_ATTN, PREFILL_GROUP_MAX, PagedKernel
from kvflow.stages.engine.pages import KVLayout, PagePool
from tests.stages.engine.conftest import cpu_has, open_engine

needs_kernel = pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("cc") is None,
    reason="the kernels are built on Linux with a C compiler",
)

# (kv heads, group, head dim, block, start, T)
SHAPES = [
    (3, 3, 64, 64, 0, 130),  # SmolLM2-135M's heads and pages, a first chunk
    (3, 3, 64, 64, 512, 77),  # a later chunk: 77 = 4 items of 16 positions and 13
    (3, 3, 64, 64, 40, 1),  # one query inside a page
    (2, 4, 40, 16, 21, 50),  # a chunk starting inside a page, many pages crossed
    (1, 1, 128, 5, 3, 61),  # odd pages, no grouping (48 positions an item)
    (4, 2, 17, 7, 30, 33),  # head dim 17: masked tails
    (2, 8, 64, 128, 100, 40),  # pages longer than a tile (64 keys)
    (1, 48, 16, 8, 9, 5),  # the most query heads a KV head: one position an item
]


pytestmark = pytest.mark.usefixtures("restore_threads")


def _case(
    shape: tuple[int, ...], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(pool [pages, 2 layers, 2, kvh, block, d], the request's pages in random order, q as
    a strided view [T, kvh * group, d] of a wider projection output, start)."""
    kvh, group, d, bs, start, t = shape
    gen = torch.Generator().manual_seed(seed)
    n = (start + t + bs - 1) // bs
    pool = torch.randn(n + 6, 2, 2, kvh, bs, d, generator=gen) * 2
    pages = torch.randperm(n + 6, generator=gen)[:n].contiguous()
    wide = torch.randn(t, kvh * group + 2 * kvh, d, generator=gen) * 2
    return pool, pages, wide[:, : kvh * group], start


def _reference(
    pool: torch.Tensor, layer: int, pages: torch.Tensor, start: int, q: torch.Tensor
) -> torch.Tensor:
    """Causal attention of q (positions start..) over the pool's slots 0..start + T - 1 of
    `pages`, read slot by slot, in float64."""
    t, heads, d = q.shape
    kvh, bs = pool.shape[3], pool.shape[4]
    end = start + t
    kv = torch.stack([pool[int(pages[p // bs]), layer, :, :, p % bs] for p in range(end)], 2)
    kv = kv.double().repeat_interleave(heads // kvh, 1)  # [2, heads, end, d]
    s = q.double().transpose(0, 1) @ kv[0].transpose(1, 2) / math.sqrt(d)
    visible = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    return (s.softmax(-1) @ kv[1]).transpose(0, 1).float()  # [T, heads, d]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_kernel_equals_reference(kernel: PagedKernel, shape: tuple[int, ...]) -> None:
    pool, pages, q, start = _case(shape, seed=sum(shape))
    want = _reference(pool, 1, pages, start, q)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        got = kernel.prefill(pool, 1, pages, start, q)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _new_kv(
    pool: torch.Tensor, pages: torch.Tensor, start: int, t: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's K/V as strided views [T, kvh, d] of one wider projection output (as the
    fused q/k/v projection gives them), and the pool with them written by torch's
    `index_put` (the path the kernel's write replaces)."""
    kvh, bs, d = pool.shape[3], pool.shape[4], pool.shape[5]
    wide = torch.randn(t, 3 * kvh, d, generator=torch.Generator().manual_seed(seed))
    k, v = wide[:, kvh : 2 * kvh], wide[:, 2 * kvh :]
    positions = torch.arange(start, start + t)
    want = pool.clone()
    want[pages[positions // bs], 1, :, :, positions % bs] = torch.stack((k, v), dim=1)
    return k, v, want


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_kernel_writes_the_chunks_kv(kernel: PagedKernel, shape: tuple[int, ...]) -> None:
    """With new_kv the kernel writes the chunk's K/V into its slots (the pool bit for bit as
    torch's index_put leaves it, nothing else touched), then attends over them."""
    for threads in (1, 2):
        torch.set_num_threads(threads)
        pool, pages, q, start = _case(shape, seed=sum(shape) + threads)
        k, v, want_pool = _new_kv(pool, pages, start, q.shape[0], seed=threads)
        got = kernel.prefill(pool, 1, pages, start, q, (k, v))
        assert torch.equal(pool, want_pool)
        want = _reference(want_pool, 1, pages, start, q)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_prefill_kernel_checks_its_arguments(kernel: PagedKernel) -> None:
    pool = torch.zeros(4, 1, 2, 2, 8, 16)
    pages, q = torch.tensor([0, 1]), torch.zeros(5, 4, 16)
    with pytest.raises(ValueError, match="pool"):
        kernel.prefill(pool.double(), 0, pages, 0, q)
    with pytest.raises(ValueError, match="q must be"):
        kernel.prefill(pool, 0, pages, 0, torch.zeros(5, 3, 16))
    with pytest.raises(ValueError, match="pages must be"):
        kernel.prefill(pool, 0, pages.int(), 0, q)
    with pytest.raises(ValueError, match="do not cover"):
        kernel.prefill(pool, 0, pages, 12, q)
    with pytest.raises(ValueError, match="query heads"):
        kernel.prefill(pool, 0, pages, 0, torch.zeros(5, 2 * (PREFILL_GROUP_MAX + 1), 16))
    kv = torch.zeros(5, 2, 16)
    with pytest.raises(ValueError, match="new k must be"):
        kernel.prefill(pool, 0, pages, 0, q, (torch.zeros(4, 2, 16), kv))
    with pytest.raises(ValueError, match="new v must be"):
        kernel.prefill(pool, 0, pages, 0, q, (kv, kv.double()))
    with pytest.raises(ValueError, match="new k must be"):
        kernel.prefill(pool, 0, pages, 0, q, (torch.zeros(5, 16, 2).transpose(1, 2), kv))


def _pool(kvh: int, bs: int, d: int) -> PagePool:
    layout = KVLayout(num_layers=2, num_kv_heads=kvh, head_dim=d, block_size=bs, dtype="float32")
    pool = PagePool(24, layout, torch.float32, torch.device("cpu"))
    pool.tensor.normal_(generator=torch.Generator().manual_seed(5))
    return pool


@needs_kernel
@pytest.mark.parametrize(
    ("start", "t", "window", "kernel_used"),
    [(0, 45, None, True), (19, 30, None, True), (40, 9, 64, True), (40, 9, 20, False)],
)
def test_paged_prefill_equals_torch_path(
    start: int, t: int, window: int | None, kernel_used: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk with the kernel writes the same K/V and attends to the torch path's answer; a
    window that hides earlier tokens keeps torch's path."""
    kvh, group, d, bs = 2, 3, 16, 8
    gen = torch.Generator().manual_seed(start + t)
    page_ids = torch.tensor([11, 3, 7, 0, 20, 9, 14, 2])
    q = torch.randn(t, kvh * group, d, generator=gen)
    k, v = torch.randn(t, kvh, d, generator=gen), torch.randn(t, kvh, d, generator=gen)
    outs, pools = {}, {}
    for setting in ("torch", "paged"):
        monkeypatch.setenv(ENV_ATTN, setting)
        pool = _pool(kvh, bs, d)
        prefill = PagedPrefill(pool, page_ids, start, t, window)
        assert (prefill.kernel is not None) == (setting == "paged" and kernel_used)
        outs[setting] = prefill.attend(1, q, k, v)
        pools[setting] = pool.tensor
    assert torch.equal(pools["paged"], pools["torch"])
    torch.testing.assert_close(outs["paged"], outs["torch"], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bad", [-1, 24])
def test_paged_prefill_refuses_page_ids_outside_the_pool(
    bad: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel writes through the page ids: one outside the pool is an IndexError before
    anything is written, as torch's indexing was."""
    monkeypatch.setenv(ENV_ATTN, "paged")
    pool = _pool(2, 8, 16)
    before = pool.tensor.clone()
    with pytest.raises(IndexError, match="out of range for 24 pages"):
        PagedPrefill(pool, torch.tensor([11, bad, 7]), 0, 20, None)
    assert torch.equal(pool.tensor, before)


@needs_kernel
def test_paged_prefill_leaves_too_many_query_heads_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_ATTN, "paged")
    group, d, t = PREFILL_GROUP_MAX + 2, 8, 5
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(t, group, d, generator=gen)
    k, v = torch.randn(t, 1, d, generator=gen), torch.randn(t, 1, d, generator=gen)
    pool = _pool(1, 4, d)
    out = PagedPrefill(pool, torch.tensor([4, 6]), 0, t, None).attend(0, q, k, v)
    want = _reference(pool.tensor, 0, torch.tensor([4, 6]), 0, q)
    torch.testing.assert_close(out, want.reshape(t, -1), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_portable_build_equals_reference(
    isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built without AVX-512 (`KVFLOW_KERNEL_ISA`: the AVX2 + FMA tiles, or the plain loops),
    the kernel gives the same answers."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx2", "fma"):
        pytest.skip("x86-64 with AVX2 and FMA only")
    monkeypatch.setenv(cpu_kernels.ENV_ISA, isa)
    monkeypatch.setenv(cpu_kernels.ENV_DIR, str(tmp_path))
    lib = cpu_kernels._load()
    assert lib is not None
    portable = PagedKernel(lib)
    for shape in (SHAPES[1], SHAPES[3], SHAPES[5]):
        pool, pages, q, start = _case(shape, seed=3)
        got = portable.prefill(pool, 1, pages, start, q)
        torch.testing.assert_close(got, _reference(pool, 1, pages, start, q), rtol=1e-5, atol=1e-5)
        k, v, want_pool = _new_kv(pool, pages, start, q.shape[0], seed=4)
        got = portable.prefill(pool, 1, pages, start, q, (k, v))
        assert torch.equal(pool, want_pool)
        want = _reference(want_pool, 1, pages, start, q)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.slow
def test_default_model_prefill_chunks_match_transformers(
    smol_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2-135M (9 query heads on 3 KV heads, pages of 64): a 300-token prompt in chunks
    of 128 (later chunks over earlier pages) gives transformers' logits and greedy tokens, and
    the same tokens as torch's attention."""
    transformers = pytest.importorskip("transformers")
    ids = [
        int(t) for t in torch.randint(20, 40000, (300,), generator=torch.Generator().manual_seed(9))
    ]
    runs = {}
    for setting in ("paged", "torch"):
        monkeypatch.setenv(ENV_ATTN, setting)
        engine = open_engine(smol_dir, block_size=64, prefill_chunk=128)
        engine.add_request("r", ids, SamplingParams(max_tokens=6, ignore_eos=True))
        outs = []
        while engine.has_unfinished():
            outs.extend(o for o in engine.step() if o.logits is not None)
        runs[setting] = [o.new_token_ids[0] for o in outs], torch.cat([o.logits for o in outs])
    tokens, logits = runs["paged"]
    assert tokens == runs["torch"][0] and len(tokens) == 6
    model = transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :].float()
    assert (logits - ref).abs().max().item() < 1e-4
    assert ref.argmax(-1).tolist() == tokens
