"""Fused float32 elementwise steps of a decoder layer on the CPU (cpu_fused.c).

A cold prefill spent ~10% of its time (512 tokens; more at 2,000) in torch's elementwise ops
around the matmuls: the residual adds and RMSNorms, RoPE (two products, a `roll` that is a
`cat`, an add), and SiLU(gate) * up over views of the fused gate/up output, each op a pass over
its tensors and a Python dispatch. Here each of those steps is one pass:

- `add_rms_norm`: the residual add and the next RMSNorm (x += delta in place; the normed x);
- `rope_`: RoPE in place on the q/k heads of the qkv output (no temporaries);
- `silu_mul`: SiLU(gate) * up from the fused gate/up output into one new tensor.

`fused_kernels(x)` is the one place that decides: a `FusedKernels` for a float32 tensor on
the CPU where the library (cpu_kernels.py) is built, unless `KVFLOW_FUSED=0` (the escape
hatch and the benchmark's A/B switch; read at each forward); None otherwise (bf16, CUDA, no
compiler), and the model keeps its torch ops. The results equal those ops' to float32
rounding: the residual add and RoPE bit for bit, RMSNorm up to the order of its sum of
squares, SiLU up to its exp (tests/stages/engine/test_cpu_fused.py).
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from kvflow.stages.engine.cpu_kernels import library

ENV_FUSED = "KVFLOW_FUSED"

_ptr, _long, _float = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class FusedKernels:
    """The bound kernels. Each takes float32 CPU tensors whose last dimension is contiguous
    (rows may be strided: views of a fused projection's output)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._add_norm = lib.kvflow_add_rms_norm
        self._add_norm.restype = None
        self._add_norm.argtypes = [_ptr, _long, _ptr, _long, _ptr, _ptr, _long, _long, _long]
        self._add_norm.argtypes += [_float, _long]
        self._rope = lib.kvflow_rope
        self._rope.restype = None
        self._rope.argtypes = [_ptr, _long, _long, _long, _long, _ptr, _ptr, _long, _long, _long]
        self._silu_mul = lib.kvflow_silu_mul
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_ptr, _long, _ptr, _long, _long, _long]

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, n] += delta [T, n] (in place; None: no add) -> (x, RMSNorm(x) * weight), the
        normed rows a new contiguous tensor."""
        _rows_of(x, "x")
        rows, n = x.shape
        out = torch.empty((rows, n), dtype=torch.float32)
        d_ptr, d_stride = None, 0
        if delta is not None:
            if delta.shape != x.shape:
                raise ValueError(f"delta {tuple(delta.shape)} is not x's {tuple(x.shape)}")
            _rows_of(delta, "delta")
            d_ptr, d_stride = delta.data_ptr(), delta.stride(0)
        if weight.shape != (n,) or not weight.is_contiguous() or weight.dtype != torch.float32:
            raise ValueError(f"weight must be contiguous float32 [{n}], got {weight.shape}")
        self._add_norm(
            x.data_ptr(), x.stride(0), d_ptr, d_stride, weight.data_ptr(), out.data_ptr(), n,
            rows, n, eps, torch.get_num_threads(),
        )  # fmt: skip
        return x, out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, d] in place by (cos, signed sin) [T, 1, d] (`Rotary.cos_sin`);
        returns x. Equals `rope.apply_rotary` bit for bit."""
        if x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2:
            raise ValueError(f"x must be [T, heads, even d] with contiguous d, got {x.shape}")
        t, heads, d = x.shape
        for name, table in (("cos", cos), ("signed_sin", signed_sin)):
            if table.shape != (t, 1, d) or not table.is_contiguous():
                raise ValueError(f"{name} must be contiguous [{t}, 1, {d}], got {table.shape}")
        self._rope(
            x.data_ptr(), x.stride(0), x.stride(1), heads, d, cos.data_ptr(),
            signed_sin.data_ptr(), d, t, torch.get_num_threads(),
        )  # fmt: skip
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (gate columns, then up) -> SiLU(gate) * up [T, I], a new tensor."""
        _rows_of(gate_up, "gate_up")
        rows, two = gate_up.shape
        if two % 2:
            raise ValueError(f"gate_up has an odd width {two}")
        out = torch.empty((rows, two // 2), dtype=torch.float32)
        self._silu_mul(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, two // 2,
            torch.get_num_threads(),
        )  # fmt: skip
        return out


def _rows_of(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1 or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be float32 CPU rows [T, n] with contiguous n")


_lock = threading.Lock()
_bound: dict[str, FusedKernels | None] = {}


def kernels() -> FusedKernels | None:
    """The kernels, bound once per process; None where the library is not available."""
    with _lock:
        if "fused" not in _bound:
            lib = library()
            _bound["fused"] = None if lib is None else FusedKernels(lib)
        return _bound["fused"]


def fused_enabled() -> bool:
    """`KVFLOW_FUSED` (default on): "0" keeps torch's ops."""
    value = os.environ.get(ENV_FUSED, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_FUSED} must be 0 or 1, got {value!r}")
    return value == "1"


def fused_kernels(x: torch.Tensor) -> FusedKernels | None:
    """The kernels for a forward whose activations are `x`: float32 on the CPU, the library
    built here, `KVFLOW_FUSED` not 0; else None (the torch ops)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not fused_enabled():
        return None
    return kernels()
