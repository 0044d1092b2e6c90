"""Paged decode and prefill attention for a float32 page pool on the CPU (cpu_attn.c,
cpu_prefill.c).

torch's attention takes a contiguous K/V, so a decode batch gathered each row's pages into a
padded context first (`index_select`: ~13 MB a layer for a burst's dozen decodes) and masked
the padding. `cpu_attn.c` reads each row's keys where they lie in the pool, through the
row's page list, with an online softmax over tiles of a page (flash style), the rows' KV
heads and parts of long rows spread over torch's OpenMP threads; it also writes the rows'
new K/V into their slots first, so a decode layer's attention is one call. `prefill`
(cpu_prefill.c) writes a chunk's K/V into its slots the same way (no torch `index_put`) and
attends the chunk's queries causally over its request's pages in place, in
tiles of 48 query rows (a block's positions times the query heads of a KV head) by up to 64
keys of a page, with register-blocked score and value microkernels; torch's path instead
gathered the context and ran its flash kernel in query blocks (`attention.blocked_causal`).

`paged_kernel(pool)` is the one place that decides: a `PagedKernel` for a float32 pool on the
CPU where the library (cpu_kernels.py) is built, unless `KVFLOW_ATTN=torch` (the escape
hatch and the benchmark's A/B switch; read when a step's backend is built); None otherwise
(bf16, CUDA, no compiler), and `attention.PagedDecode` and `PagedPrefill` keep torch's
path. Results equal torch's attention to float32 rounding (tests/stages/engine/
test_cpu_attn.py, test_cpu_prefill.py).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading

import torch

from kvflow.stages.engine.cpu_kernels import library

ENV_ATTN = "KVFLOW_ATTN"
ATTN_SETTINGS = ("paged", "torch")

PREFILL_GROUP_MAX = 48
"""The most query heads a KV head that the prefill kernel takes (cpu_prefill.c's ROWS)."""

_ptr, _long, _float = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class PagedKernel:
    """The bound kernel (`attend`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.kvflow_paged_attention
        fn.restype = None
        fn.argtypes = [_ptr, _long, _long, _long, _long, _long, _ptr, _long, _ptr, _long]
        fn.argtypes += [_ptr, _long, _long, _long, _long, _long, _float, _ptr, _ptr]
        fn.argtypes += [_ptr, _long, _long, _ptr, _long, _long, _ptr, _long]
        self._fn = fn
        pf = lib.kvflow_paged_prefill
        pf.restype = ctypes.c_int
        pf.argtypes = [_ptr, _long, _long, _long, _long, _long, _ptr, _long, _long, _ptr]
        pf.argtypes += [_long, _long, _long, _long, _long, _float, _ptr]
        pf.argtypes += [_ptr, _long, _long, _ptr, _long, _long, _long]
        self._prefill = pf

    def prefill(
        self,
        pool: torch.Tensor,
        layer: int,
        pages: torch.Tensor,
        start: int,
        q: torch.Tensor,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Causal attention of a chunk's queries at positions [start, start + T) over its
        request's keys [0, start + T) in the pool (cpu_prefill.c).

        pool [pages, layers, 2, kv_heads, block, d] float32; pages: the request's page ids
        in block order (int64, contiguous), covering position start + T - 1; q
        [T, kv_heads * G, d] (the G query heads of a KV head consecutive, d contiguous).
        new_kv (k, v): the chunk's own K/V [T, kv_heads, d] float32 (d contiguous), written
        into the slots of positions [start, start + T) first; None: the pool holds them
        already. Returns [T, kv_heads * G, d]."""
        kvh, block, d, group = _shapes(pool, q)
        t = q.shape[0]
        if t < 1:
            raise ValueError("q must have at least one row")
        if pages.dim() != 1 or pages.dtype != torch.int64 or not pages.is_contiguous():
            raise ValueError("pages must be a contiguous int64 vector")
        if start < 0 or pages.shape[0] * block < start + t:
            raise ValueError(f"{pages.shape[0]} pages of {block} do not cover {start + t} tokens")
        if group > PREFILL_GROUP_MAX:
            raise ValueError(f"at most {PREFILL_GROUP_MAX} query heads a KV head, got {group}")
        kv_args: list[int | None] = [None, 0, 0, None, 0, 0]
        if new_kv is not None:
            for name, x in zip(("k", "v"), new_kv, strict=True):
                if x.shape != (t, kvh, d) or x.stride(2) != 1 or x.dtype != torch.float32:
                    raise ValueError(f"new {name} must be float32 [{t}, {kvh}, {d}]")
            k, v = new_kv
            kv_args = [k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0)]
            kv_args += [v.stride(1)]
        out = torch.empty((t, kvh * group, d), dtype=torch.float32)
        base = pool[:, layer]
        rc = self._prefill(
            base.data_ptr(), pool.stride(0), pool.stride(2), pool.stride(3), pool.stride(4),
            block, pages.data_ptr(), start, t, q.data_ptr(), q.stride(0), q.stride(1), kvh,
            group, d, 1.0 / math.sqrt(d), out.data_ptr(), *kv_args, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError("the prefill kernel refused its arguments")
        return out

    def attend(
        self,
        pool: torch.Tensor,
        layer: int,
        table: torch.Tensor,
        ranges: torch.Tensor,
        q: torch.Tensor,
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's queries over its keys in the pool.

        pool [pages, layers, 2, kv_heads, block, d] float32; table [R, n] int64 (each row's
        page ids, contiguous); ranges [R, 2] int64 (each row's keys [lo, hi) as positions in
        its table, contiguous); q [R, kv_heads * Q, d] (the Q query heads of a KV head
        consecutive, d contiguous). new_kv (k, v, slots): the rows' new K/V [R, kv_heads, d]
        written first at slots [R, 2] (page, slot), int64 contiguous. Returns out
        [R, kv_heads * Q, d] and, with `lse`, each query's log-sum-exp [R, kv_heads * Q]
        (natural log, of the scaled scores; -inf for a row without keys, whose out is 0)."""
        kvh, block, d, group = _shapes(pool, q)
        rows = q.shape[0]
        for name, t, cols in (("table", table, table.shape[-1]), ("ranges", ranges, 2)):
            if t.shape != (rows, cols) or t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous int64 [{rows}, {cols}]")
        out = torch.empty((rows, kvh * group, d), dtype=torch.float32)
        lse_out = torch.empty((rows, kvh * group), dtype=torch.float32) if lse else None
        k_args: list[int | None] = [None, 0, 0, None, 0, 0, None]
        if new_kv is not None:
            k, v, slots = new_kv
            for name, t in (("k", k), ("v", v)):
                if t.shape != (rows, kvh, d) or t.stride(2) != 1 or t.dtype != torch.float32:
                    raise ValueError(f"new {name} must be float32 [{rows}, {kvh}, {d}]")
            if slots.shape != (rows, 2) or slots.dtype != torch.int64 or not slots.is_contiguous():
                raise ValueError(f"slots must be contiguous int64 [{rows}, 2]")
            k_args = [k.data_ptr(), k.stride(0), k.stride(1)]
            k_args += [v.data_ptr(), v.stride(0), v.stride(1), slots.data_ptr()]
        base = pool[:, layer]
        self._fn(
            base.data_ptr(), pool.stride(0), pool.stride(2), pool.stride(3), pool.stride(4),
            block, table.data_ptr(), table.shape[1], ranges.data_ptr(), rows,
            q.data_ptr(), q.stride(0), q.stride(1), kvh, group, d, 1.0 / math.sqrt(d),
            out.data_ptr(), None if lse_out is None else lse_out.data_ptr(), *k_args,
            torch.get_num_threads(),
        )  # fmt: skip
        return out, lse_out


def _shapes(pool: torch.Tensor, q: torch.Tensor) -> tuple[int, int, int, int]:
    """(kv_heads, block, head_dim, query heads a KV head) of a pool and the queries the
    kernels take; ValueError naming what does not fit."""
    if pool.dtype != torch.float32 or pool.device.type != "cpu" or pool.dim() != 6:
        raise ValueError("the pool must be a float32 CPU tensor [pages, layers, 2, h, b, d]")
    if pool.stride(5) != 1:
        raise ValueError("the pool's head_dim must be contiguous")
    _, _, _, kvh, block, d = pool.shape
    if q.dim() != 3 or q.stride(2) != 1 or q.shape[2] != d or q.shape[1] % kvh:
        raise ValueError(f"q must be [rows, a multiple of {kvh} heads, {d}], d contiguous")
    if q.dtype != torch.float32:
        raise ValueError(f"q must be float32, got {q.dtype}")
    return kvh, block, d, q.shape[1] // kvh


_lock = threading.Lock()
_bound: dict[str, PagedKernel | None] = {}


def kernel() -> PagedKernel | None:
    """The kernel, bound once per process; None where the library is not available."""
    with _lock:
        if "attn" not in _bound:
            lib = library()
            _bound["attn"] = None if lib is None else PagedKernel(lib)
        return _bound["attn"]


def attn_setting() -> str:
    """`KVFLOW_ATTN` (default "paged"): "torch" keeps torch's attention."""
    value = os.environ.get(ENV_ATTN, "paged")
    if value not in ATTN_SETTINGS:
        raise ValueError(f"{ENV_ATTN} must be one of {', '.join(ATTN_SETTINGS)}, got {value!r}")
    return value


def paged_kernel(pool: torch.Tensor) -> PagedKernel | None:
    """The kernel for a page pool: float32 on the CPU, the library built here, `KVFLOW_ATTN`
    not "torch"; else None (torch's attention)."""
    if pool.dtype != torch.float32 or pool.device.type != "cpu" or attn_setting() == "torch":
        return None
    return kernel()
