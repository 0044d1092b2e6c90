"""The paged decode attention kernel (cpu_attn.py) against a float64 reference that reads the
pool slot by slot, and `PagedDecode` with it against torch's path (`KVFLOW_ATTN=torch`):
many shapes (grouped-query heads, head dims and page sizes that are not multiples of 16),
windows, rows of different lengths crossing page boundaries, 1 and 2 threads, long rows
split in parts; and an engine's greedy tokens and logits with and without it."""

from __future__ import annotations

import ctypes
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from kvflow.stages.engine import SamplingParams, cpu_attn
from kvflow.stages.engine.attention import PagedDecode
from kvflow.stages.engine.cpu_attn import ENV_ATTN, PagedKernel, paged_kernel
from kvflow.stages.engine.pages import KVLayout, PagePool
from tests.stages.engine.conftest import open_engine

needs_kernel = pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("cc") is None,
    reason="the kernels are built on Linux with a C compiler",
)

# (pages, layers, kv heads, block, head dim, group, rows, table width)
SHAPES = [
    (40, 2, 3, 64, 64, 3, 4, 12),  # SmolLM2-135M's heads and pages
    (30, 1, 2, 16, 40, 4, 3, 10),
    (50, 3, 1, 5, 128, 1, 5, 30),  # odd block, one KV head, no grouping
    (20, 2, 4, 7, 17, 2, 2, 9),  # head dim 17: masked tails
    (90, 1, 2, 8, 64, 8, 2, 80),  # long rows (640 keys): split in parts
]


pytestmark = pytest.mark.usefixtures("restore_threads")


def _reference(
    pool: torch.Tensor, layer: int, table: torch.Tensor, ranges: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's queries over its keys [lo, hi), read slot by slot, in float64."""
    rows, heads, d = q.shape
    kvh, bs = pool.shape[3], pool.shape[4]
    outs, lses = [], []
    for r in range(rows):
        lo, hi = ranges[r].tolist()
        slots = [pool[int(table[r, t // bs]), layer, :, :, t % bs] for t in range(lo, hi)]
        kv = torch.stack(slots, 2).double()  # [2, kvh, n, d]
        qg = q[r].reshape(kvh, heads // kvh, d).double()
        s = qg @ kv[0].transpose(1, 2) / math.sqrt(d)
        outs.append((s.softmax(-1) @ kv[1]).reshape(heads, d))
        lses.append(torch.logsumexp(s, -1).reshape(heads))
    return torch.stack(outs).float(), torch.stack(lses).float()


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_reference(isa_library: ctypes.CDLL, shape: tuple[int, ...]) -> None:
    """As loaded, and built for AVX2 and for plain loops (`isa_library`)."""
    kernel = PagedKernel(isa_library)
    pages, layers, kvh, bs, d, group, rows, width = shape
    gen = torch.Generator().manual_seed(sum(shape))
    pool = torch.randn(pages, layers, 2, kvh, bs, d, generator=gen) * 2
    table = torch.stack([torch.randperm(pages, generator=gen)[:width] for _ in range(rows)])
    hi = torch.randint(1, width * bs + 1, (rows,), generator=gen)
    hi[0] = width * bs  # a row that fills its table
    lo = (hi - torch.randint(1, 3 * bs, (rows,), generator=gen)).clamp(min=0)
    lo[-1] = 0  # a row from its first key
    ranges = torch.stack((lo, hi), 1).contiguous()
    q = torch.randn(rows, kvh * group, d, generator=gen) * 2
    want, want_lse = _reference(pool, layers - 1, table, ranges, q)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out, lse = kernel.attend(pool, layers - 1, table, ranges, q, lse=True)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert lse is not None
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_writes_the_new_kv_first_and_strided_queries(kernel: PagedKernel) -> None:
    """The rows' new K/V land in their slots (and are attended); q, k and v may be views of
    a wider projection output (strided rows, as the model's q/k/v arrive); a row without
    keys gives 0 and a log-sum-exp of -inf."""
    gen = torch.Generator().manual_seed(7)
    kvh, bs, d, group = 2, 8, 16, 3
    pool = torch.randn(10, 2, 2, kvh, bs, d, generator=gen)
    table = torch.tensor([[4, 7, 1], [2, 9, 9], [3, 3, 3]])
    ranges = torch.tensor([[0, 19], [5, 12], [0, 0]])
    slots = torch.tensor([[1, 2], [9, 3], [3, 0]])
    wide = torch.randn(3, kvh * group + 2 * kvh + 1, d, generator=gen)
    q, k, v = wide[:, : kvh * group], wide[:, kvh * group : -kvh - 1], wide[:, -kvh - 1 : -1]
    before = pool.clone()
    out, lse = kernel.attend(pool, 1, table, ranges, q, (k, v, slots), lse=True)
    for r in range(3):
        page, slot = slots[r].tolist()
        assert torch.equal(pool[page, 1, 0, :, slot], k[r])
        assert torch.equal(pool[page, 1, 1, :, slot], v[r])
        pool[page, 1, :, :, slot] = before[page, 1, :, :, slot]
    assert torch.equal(pool, before)  # nothing else written
    for r in range(3):
        page, slot = slots[r].tolist()
        pool[page, 1, 0, :, slot], pool[page, 1, 1, :, slot] = k[r], v[r]
    want, want_lse = _reference(pool, 1, table[:2], ranges[:2], q[:2])
    torch.testing.assert_close(out[:2], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert lse is not None and torch.isneginf(lse[2]).all()
    torch.testing.assert_close(lse[:2], want_lse, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_checks_its_arguments(kernel: PagedKernel) -> None:
    pool = torch.zeros(4, 1, 2, 2, 8, 16)
    table, ranges = torch.zeros(1, 2, dtype=torch.int64), torch.tensor([[0, 3]])
    q = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="pool"):
        kernel.attend(pool.double(), 0, table, ranges, q)
    with pytest.raises(ValueError, match="q must be"):
        kernel.attend(pool, 0, table, ranges, torch.zeros(1, 3, 16))
    with pytest.raises(ValueError, match="table"):
        kernel.attend(pool, 0, table.int(), ranges, q)
    with pytest.raises(ValueError, match="ranges"):
        kernel.attend(pool, 0, table, torch.tensor([[0, 3, 4]]), q)
    with pytest.raises(ValueError, match="new k"):
        kernel.attend(pool, 0, table, ranges, q, (torch.zeros(1, 3, 16), q, ranges))


def _decode_pool(kvh: int, bs: int, d: int, seed: int) -> PagePool:
    layout = KVLayout(num_layers=2, num_kv_heads=kvh, head_dim=d, block_size=bs, dtype="float32")
    pool = PagePool(24, layout, torch.float32, torch.device("cpu"))
    pool.tensor.normal_(generator=torch.Generator().manual_seed(seed))
    return pool


BATCHES = [
    # (rows' page lists, positions): one row in a page, one over pages, rows of
    # different lengths, rows that share their first pages (torch's cascade)
    ([[5]], [3]),
    ([[9, 2, 11, 4]], [29]),
    ([[1, 2, 3, 3], [4, 5, 6, 7], [8, 8, 8, 8]], [20, 31, 0]),
    ([[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6, 6], [10, 12, 12, 12]], [27, 19, 17, 9]),
]


@needs_kernel
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("window", [None, 64, 6])
@pytest.mark.parametrize("kvh,group,d", [(2, 3, 16), (1, 4, 64), (3, 1, 20)])
def test_paged_decode_equals_torch_path(
    batch: tuple[list[list[int]], list[int]],
    window: int | None,
    kvh: int,
    group: int,
    d: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows, pos = batch
    gen = torch.Generator().manual_seed(len(rows) * 100 + d)
    b = len(rows)
    q = torch.randn(b, kvh * group, d, generator=gen)
    k, v = torch.randn(b, kvh, d, generator=gen), torch.randn(b, kvh, d, generator=gen)
    outs, pools = {}, {}
    for setting in ("torch", "paged"):
        monkeypatch.setenv(ENV_ATTN, setting)
        pool = _decode_pool(kvh, 8, d, seed=1)
        decode = PagedDecode(pool, torch.tensor(rows), torch.tensor(pos), window)
        assert (decode.kernel is not None) == (setting == "paged")
        outs[setting] = decode.attend(1, q, k, v)
        pools[setting] = pool.tensor
    assert torch.equal(pools["paged"], pools["torch"])  # the same K/V written, in place
    torch.testing.assert_close(outs["paged"], outs["torch"], rtol=1e-5, atol=1e-5)


def test_paged_kernel_only_for_a_cpu_float32_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_ATTN, raising=False)
    assert paged_kernel(torch.zeros(1, dtype=torch.bfloat16)) is None
    assert paged_kernel(torch.zeros(1, device="meta")) is None
    assert paged_kernel(torch.zeros(1)) is cpu_attn.kernel()
    monkeypatch.setenv(ENV_ATTN, "torch")
    assert paged_kernel(torch.zeros(1)) is None
    monkeypatch.setenv(ENV_ATTN, "fast")
    with pytest.raises(ValueError, match=ENV_ATTN):
        paged_kernel(torch.zeros(1))


@needs_kernel
def test_engine_logits_with_and_without_the_kernel(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests of different lengths, prefilled in chunks, then decoded together: the
    same greedy tokens and logits to float32 rounding with the kernel as with torch's
    attention."""
    prompts = {"a": [(7 * i + 3) % 200 + 5 for i in range(40)], "b": list(range(9, 30))}
    runs = {}
    for setting in ("paged", "torch"):
        monkeypatch.setenv(ENV_ATTN, setting)
        engine = open_engine(llama_dir, prefill_chunk=16)
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        logits = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
                if o.logits is not None:
                    logits.append(o.logits)
        runs[setting] = tokens, torch.cat(logits)
    assert runs["paged"][0] == runs["torch"][0]
    assert all(len(t) == 12 for t in runs["paged"][0].values())
    torch.testing.assert_close(runs["paged"][1], runs["torch"][1], rtol=1e-4, atol=1e-4)


def test_unknown_attn_setting_fails_at_load(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_ATTN, "flash")
    with pytest.raises(ValueError, match=ENV_ATTN):
        open_engine(tiny_dir)


def test_without_the_library_decode_keeps_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (or another OpenMP runtime): `kernel()` is None and a decode batch attends
    with torch, to the same answer."""
    monkeypatch.delenv(ENV_ATTN, raising=False)
    monkeypatch.setattr(cpu_attn, "kernel", lambda: None)
    pool = _decode_pool(2, 8, 16, seed=2)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 16, generator=gen) for h in (6, 2, 2))
    decode = PagedDecode(pool, torch.tensor([[1, 2], [3, 4]]), torch.tensor([9, 12]), None)
    assert decode.kernel is None
    out = decode.attend(0, q, k, v)
    want, _ = _reference(
        pool.tensor, 0, torch.tensor([[1, 2], [3, 4]]), torch.tensor([[0, 10], [0, 13]]), q
    )
    torch.testing.assert_close(out, want.reshape(2, -1), rtol=1e-5, atol=1e-5)
