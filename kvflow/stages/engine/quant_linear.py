"""Weight-only int8 and int4 linears on torch's CPU kernels (precision.py says which).

`quantize_linears(module, precision, compute)` replaces every `nn.Linear` under `module` by an
`Int8Linear` or `Int4Linear` built from the linear's float weight (quantize from float32 for
the best rounding). Activations, the bias and the output stay in `compute` (bfloat16 for the
engine's int8/int4): only the weight is stored low-bit and dequantized inside the kernel.

- `Int8Linear`: `q = round(w / s)` in [-127, 127] with `s = max|w_row| / 127` per output row;
  `y = x @ (q * s).T` by `torch._weight_int8pack_mm(x, q[N, K], s[N])` for a few rows (a
  decode step: the kernel reads a quarter of float32's bytes). From `DEQUANT_ROWS` rows on (a
  prefill chunk) `F.linear` multiplies by `q` converted to the compute dtype for that call
  (exact: |q| <= 127) and the output columns are scaled: at 512 rows the int8 kernel ran
  2.7x slower than that here.
- `Int4Linear`: per row and group of `group_size` input columns, `s = (max - min) / 15`,
  `q = round((w - min) / s)` in [0, 15], stored as `(q - 8) * s + zero` with
  `zero = min + 8 s` — the layout `torch._weight_int4pack_mm_for_cpu` reads (scales and zeros
  `[K / group, N, 2]`, the weight packed by `torch._convert_weight_to_int4pack_for_cpu`).
  From `DEQUANT_ROWS` rows on (a prefill chunk) the nibbles are unpacked for that call into
  the compute dtype, `W = q * s + (zero - 8 s)` per group, and `x @ W.T` is one matmul: at
  512 rows the int4 kernel ran at about half of bf16's rate here (docs/performance.md). No
  second copy of the weight is kept: the unpacking reads torch's own CPU layout (blocks of
  64 output rows, per input column 32 bytes: row i in the low nibble, row 32 + i in the
  high), checked against `q` when the module is built; a weight whose layout does not check
  (fewer than 64 or a non-multiple of 64 rows) keeps the kernel for every call.

`dequantized()` gives each module's weight as the kernel sees it (float32 `[N, K]`), for tests
and for the error bound: every element is within half a step (`s / 2`) of the float weight.
`missing_kernel(bits, device)` names what this torch build or device lacks, or None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.stages.engine.linear_swap import swap_linears
from kvflow.stages.engine.precision import Precision

_INT8_OP = "_weight_int8pack_mm"
_INT4_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
_TINY = 1e-8  # the smallest scale: an all-zero row or a constant group quantizes exactly
DEQUANT_ROWS = 32
"""From this many rows on, `Int8Linear` and `Int4Linear` dequantize their weight for the call
(a prefill chunk); below, the int8 / int4 kernel (a decode batch)."""
INT4_BLOCKS_N = (64, 32)
"""Output rows per block of torch's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`):
64 where ATen runs its AVX-512 kernels, 32 with AVX2; each `Int4Linear` finds its own."""


def missing_kernel(bits: int, device: torch.device) -> str | None:
    """Why weight-only `bits`-bit linears cannot run on `device` with this torch, or None."""
    ops = (_INT8_OP,) if bits == 8 else _INT4_OPS
    absent = [op for op in ops if not hasattr(torch, op)]
    if absent:
        return f"torch {torch.__version__} has no {', '.join('torch.' + op for op in absent)}"
    if device.type != "cpu":
        return (
            f"int{bits} weights run on torch's CPU kernels ({', '.join(ops)}); "
            f"device {device} has none here (use bfloat16 or float16 on it)"
        )
    return None


def _bias(linear: nn.Linear, compute: torch.dtype) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().to(compute)


class Int8Linear(nn.Module):
    """`y = x @ (q * s).T + b` with q int8 `[N, K]` and one scale per output row."""

    def __init__(self, linear: nn.Linear, compute: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().to(torch.float32)
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=_TINY)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("packed", q.contiguous(), persistent=False)
        self.register_buffer("scales", scales.to(compute), persistent=False)
        self.register_buffer("bias", _bias(linear, compute), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= DEQUANT_ROWS:  # q is exact in bf16; the row scale goes on the output
            y = F.linear(x, self.packed.to(x.dtype)) * self.scales
        else:
            y = torch._weight_int8pack_mm(x.contiguous(), self.packed, self.scales)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.packed.to(torch.float32) * self.scales.to(torch.float32)[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(nn.Module):
    """`y = x @ W.T + b` with W int4 in groups of `group_size` input columns, each group's
    scale and zero point in the compute dtype."""

    def __init__(self, linear: nn.Linear, compute: torch.dtype, group_size: int) -> None:
        super().__init__()
        n, k = linear.out_features, linear.in_features
        if k % group_size:
            raise ValueError(
                f"int4 needs in_features divisible by the group size {group_size}, got {k}"
            )
        self.in_features, self.out_features, self.group_size = k, n, group_size
        w = linear.weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15.0).clamp(min=_TINY)
        q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15)
        q = q.to(torch.int32).reshape(n, k)
        zeros = low + 8.0 * scales
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales_zeros.to(compute), persistent=False)
        self.register_buffer("bias", _bias(linear, compute), persistent=False)
        # the dequantizing path's per-group scale and offset `zero - 8 s` in the packing's
        # order, [N / 64, K / group, 1, 2, 32] (~2 bytes per 8 weights in bf16), from the
        # scales and zeros the kernel reads; None: the packing did not check, the kernel
        # takes every call
        self.block_n = next(
            (b for b in INT4_BLOCKS_N if _unpacks_to(_unpack_int4(packed, n, k, b), q)), 0
        )
        ok = self.block_n > 0
        read = self.scales.to(torch.float32)  # [K / group, N, 2]
        self.register_buffer(
            "deq_scale",
            _packing_order(read[..., 0], compute, self.block_n) if ok else None,
            persistent=False,
        )
        self.register_buffer(
            "deq_offset",
            _packing_order(read[..., 1] - 8.0 * read[..., 0], compute, self.block_n)
            if ok
            else None,
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= DEQUANT_ROWS and self.deq_scale is not None:
            y = x @ self.weight_t()
        else:
            y = torch._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.packed, self.group_size, self.scales
            )
        return y if self.bias is None else y + self.bias

    def weight_t(self) -> torch.Tensor:
        """W.T `[K, N]` in the compute dtype for one call: `q * s + (zero - 8 s)` per group,
        computed in the packing's order (each block of B = 64 or 32 rows is a `[K, B]` slab of W.T:
        the scales are arranged to match, so the multiply-add runs over contiguous memory and
        one copy puts the slabs side by side)."""
        n, k, g, bn = self.out_features, self.in_features, self.group_size, self.block_n
        assert self.deq_scale is not None and self.deq_offset is not None
        blocks = self.packed.view(n // bn, k, bn // 2)
        nibbles = torch.stack((blocks & 15, blocks >> 4), dim=2)  # [N / B, K, 2, B / 2]
        values = nibbles.view(n // bn, k // g, g, 2, bn // 2)
        slabs = torch.addcmul(self.deq_offset, values, self.deq_scale)
        return slabs.view(n // bn, k, bn).transpose(0, 1).reshape(k, n)

    def dequantized(self) -> torch.Tensor:
        """Through the kernel itself: the identity's rows times W.T (unpacking is the
        kernel's business)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        scales = self.scales.to(torch.float32)
        w_t = torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, scales)
        return w_t.t().contiguous()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 group={self.group_size}"
        )


def _unpack_int4(packed: torch.Tensor, n: int, k: int, block_n: int) -> torch.Tensor | None:
    """The 4-bit values `[N, K]` (uint8, 0..15) of a weight packed by torch's CPU int4
    packing in blocks of `block_n` rows, or None where `n` is not a whole number of them."""
    if n % block_n or packed.dtype != torch.uint8 or packed.numel() * 2 != n * k:
        return None
    half = block_n // 2
    blocks = packed.view(n // block_n, k, half)
    nibbles = torch.stack((blocks & 15, blocks >> 4), dim=1)  # [N / B, 2, K, B / 2]
    return nibbles.transpose(2, 3).reshape(n, k)


def _unpacks_to(unpacked: torch.Tensor | None, q: torch.Tensor) -> bool:
    return unpacked is not None and torch.equal(unpacked, q.to(torch.uint8))


def _packing_order(per_group: torch.Tensor, dtype: torch.dtype, block_n: int) -> torch.Tensor:
    """`[K / group, N]` per-group values as `[N / B, K / group, 1, 2, B / 2]` in `dtype` (B =
    `block_n`): the order of `Int4Linear.weight_t`'s unpacked nibbles (row B b + B/2 h + i at
    [b, :, :, h, i])."""
    groups, n = per_group.shape
    half = block_n // 2
    arranged = per_group.view(groups, n // block_n, 2, half).permute(1, 0, 2, 3)
    return arranged.unsqueeze(2).to(dtype).contiguous()


def quantize_linears(module: nn.Module, precision: Precision, compute: torch.dtype) -> int:
    """Replace every `nn.Linear` under `module` by its `precision.weight_bits` version (after
    loading and fusing; quantizes on the linears' device). Returns the count. ValueError for a
    shape the scheme cannot take."""

    def make(linear: nn.Linear) -> nn.Module:
        if precision.weight_bits == 8:
            return Int8Linear(linear, compute)
        if precision.weight_bits == 4 and precision.group_size:
            return Int4Linear(linear, compute, precision.group_size)
        raise ValueError(f"{precision.name} is not a weight-only quantized precision")

    return swap_linears(module, make)
