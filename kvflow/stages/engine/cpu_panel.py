"""A float32 matrix product on panel-packed weights for the CPU (cpu_panel.c), every row count.

A linear's weight [N, K] is copied once into panels of `PANEL` outputs, [ceil(N / 16), K, 16]
(zero past N), and `x [M, K] @ W^T + b` runs on that copy: each step of k reads 16
consecutive weights, broadcasts each of up to 6 rows' x[m, k], and keeps 6 x 16 sums in
registers (BLIS' Haswell kernel form). On a 2-core AMD EPYC (AVX2 + FMA, no AVX-512) it ran
SmolLM2-135M's decoder linears faster than oneDNN on its prepacked weight at every row count
measured, 1 to 1,024 (most at 4-128 rows, a decode batch and a short prompt), and faster than
the matrix-vector kernel of cpu_gemv.py from 2 rows on (docs/performance.md "Panel-packed
linears"). Each output sums its products in chunks of 256 over k, in order, so a row's result
does not depend on the batch it is in or the thread count.

`panel_kernel()` is None where the kernel library cannot be built or loaded; `panel_fast()`
says whether it has the vector kernel (an AVX2 + FMA build without AVX-512): elsewhere a
plain loop computes the same products, correct but slow, and the default linear backend is
another (onednn_linear.py).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from kvflow.stages.engine.cpu_kernels import library

PANEL = 16
"""Outputs per panel (cpu_panel.c's NR)."""

PanelGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (float32, CPU) in panels: [ceil(N / PANEL), K, PANEL], contiguous,
    zero past N."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(
            f"pack needs a 2-D float32 CPU weight, got {list(weight.shape)} {weight.dtype} "
            f"on {weight.device}"
        )
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros((panels * PANEL, k), dtype=torch.float32)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def bind(lib: ctypes.CDLL) -> PanelGemm:
    """`kvflow_panel_gemm` of a loaded kernel library as a `PanelGemm`."""
    fn = lib.kvflow_panel_gemm
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4

    def gemm(
        x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        """`x` [M, K] (contiguous float32) by the packed weight of `n` outputs -> [M, n]."""
        m, k = x.shape
        y = torch.empty((m, n), dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        fn(x.data_ptr(), panels.data_ptr(), b, y.data_ptr(), m, n, k, torch.get_num_threads())
        return y

    return gemm


@functools.cache
def _load() -> tuple[PanelGemm, bool] | None:
    """The bound kernel and whether it is the vector one, once per process (`library()`
    builds and loads under its own lock)."""
    lib = library()
    if lib is None:
        return None
    fast = lib.kvflow_panel_fast
    fast.restype = ctypes.c_long
    fast.argtypes = []
    return bind(lib), bool(fast())


def panel_kernel() -> PanelGemm | None:
    """`gemm(x [M, K], panels, bias [N] | None, N) -> [M, N]` for a contiguous float32 CPU
    `x` and a `pack`ed weight, or None where the kernel cannot be built or loaded here."""
    loaded = _load()
    return None if loaded is None else loaded[0]


def panel_fast() -> bool:
    """Whether the kernel here is the vector one (AVX2 + FMA, no AVX-512)."""
    loaded = _load()
    return loaded is not None and loaded[1]


def panel_applies(x: torch.Tensor, panels: torch.Tensor) -> bool:
    """Whether a product of `x` by `panels` goes to the kernel: a 2-D contiguous float32 CPU
    `x` of the panels' K."""
    return (
        x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and x.shape[1] == panels.shape[1]
    )
