"""A float32 matrix-vector product for the few rows of a decode step on the CPU (cpu_gemv.c).

A decode step at batch 1 reads every weight once; its time is the time to read them. oneDNN's
inner product read the weights of SmolLM2-135M's linears at ~20 GB/s here on 2 threads, while
a plain read (`sum` over each weight) ran at ~28 GB/s. `cpu_gemv.c` reads each weight row once,
with AVX-512 FMAs (AVX2 FMAs, or a plain loop, elsewhere), the output rows split over torch's
OpenMP threads: ~28 GB/s at one row, the plain read's rate. Three or more rows (a decode
batch) are register-blocked, 4 weight rows by 4 input rows at a time (by 2 with AVX2), so that
loads and horizontal reductions do not dominate (BENCHMARKS.md, docs/performance.md).

The kernel is compiled and loaded with the project's other CPU kernels by cpu_kernels.py
(once per process, into a cache directory, sharing torch's OpenMP runtime); where it cannot
be, `gemv_kernel()` returns None and the linears keep oneDNN.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch

from kvflow.stages.engine.cpu_kernels import library

MAX_ROWS = 16
"""Rows (tokens) up to which `gemv` is used; above, oneDNN's inner product. Measured on
SmolLM2-135M's linears, 2 threads, 2-core AMD EPYC (`kvflow.tools.bench.gemv`, best of 5):
the blocked kernel 38-40 ms a pass at 16 rows against oneDNN's 50-54, 35 against 46 at 12,
28 against 40 at 8 (BENCHMARKS.md). Prefill chunks are longer and stay on oneDNN."""

Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

_lock = threading.Lock()
_loaded: dict[str, Gemv | None] = {}


def bind(lib: ctypes.CDLL) -> Gemv:
    """`kvflow_gemv` of a loaded kernel library as a `Gemv`."""
    fn = lib.kvflow_gemv
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4

    def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m, (n, k) = x.shape[0], weight.shape
        y = torch.empty((m, n), dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        fn(x.data_ptr(), weight.data_ptr(), b, y.data_ptr(), m, n, k, torch.get_num_threads())
        return y

    return gemv


def gemv_kernel() -> Gemv | None:
    """`gemv(x [M, K], weight [N, K], bias [N] | None) -> [M, N]` for contiguous float32 CPU
    tensors, or None where the kernel cannot be built or loaded here. Bound once per process."""
    with _lock:
        if "gemv" not in _loaded:
            lib = library()
            _loaded["gemv"] = None if lib is None else bind(lib)
        return _loaded["gemv"]


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of `x` by `weight` goes to the kernel: CPU float32, at most
    `MAX_ROWS` rows, both contiguous."""
    return (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and weight.is_contiguous()
    )
