"""A float32 decode step's decoder layers in one C call on the CPU (cpu_decode.c).

At batch 1 a decode step of SmolLM2-135M read its 538 MB of weights in ~25-28 ms of
matrix-vector products (cpu_gemv.c, at the machine's read rate) and spent 11-14 ms more,
of which the kernels between them (attention, norms, RoPE, SiLU) took ~4: the rest was Python
between ~300 kernel calls a step (module calls, argument checks, views, output tensors).
`cpu_decode.c` runs the same kernels with the same arguments in the same order in one call,
so its results are the model's modules' bit for bit (tests/stages/engine/test_cpu_decode.py).

`build_decode_layers(model)` binds a model once (`CausalLM` keeps it): a `DecodeLayers` where
the library is built and every layer's projections are fused and go to the matrix-vector
kernel (the `gemv` linears of onednn_linear.py, float32 on the CPU), or, where a projection
has a panel-packed copy (the "panel" linears), to cpu_panel.c's product on it, as its module
does; None otherwise, and the model runs its modules. `KVFLOW_DECODE=0` (the escape hatch
and the benchmark's A/B switch; read at each forward) runs the modules too.
`CausalLM.forward` takes it for a step of at most `max_rows` rows (`cpu_gemv.MAX_ROWS`, or any
decode batch where every projection has a panel copy) whose KV backend offers
`paged_rows()` (a decode batch over a float32 CPU page pool with the paged attention kernel)
and whose elementwise kernels are on (cpu_fused.py).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from typing import Any

import torch
from torch import nn

from kvflow.stages.engine.cpu_gemv import MAX_ROWS
from kvflow.stages.engine.cpu_kernels import library

ENV_DECODE = "KVFLOW_DECODE"
PANEL_ROWS = 1 << 16
"""The most rows of a call whose every projection has a panel copy: that kernel takes any
row count (cpu_panel.py), so every decode batch goes through the call; with the
matrix-vector kernel, at most `MAX_ROWS`."""
log = logging.getLogger(__name__)

_ptr, _long, _float = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
PagedRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""(pool [pages, layers, 2, kv_heads, block, d], table [M, n], ranges [M, 2], slots [M, 2]):
a decode batch's paged KV, as `attention.PagedDecode.paged_rows` gives it."""


def _f32(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
    return t


def _i64(t: torch.Tensor, shape: tuple[int, int], name: str) -> int:
    if t.shape != shape or t.dtype != torch.int64 or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous int64 {list(shape)}, got {list(t.shape)}")
    return t.data_ptr()


def _gemv_weights(linear: nn.Module | None, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of a projection that the matrix-vector kernel computes; ValueError
    if it is not one."""
    if linear is None or getattr(linear, "gemv", None) is None:
        raise ValueError(f"{name} does not go to the matrix-vector kernel")
    weight, bias = linear.weight, linear.bias
    assert isinstance(weight, torch.Tensor)
    return _f32(weight.detach(), name), None if bias is None else _f32(bias.detach(), name)


def _panel_weight(linear: nn.Module) -> torch.Tensor | None:
    """A projection's panel-packed copy (cpu_panel.py), which the kernel then computes it on;
    None where it has none."""
    packed = getattr(linear, "panel_weight", None)
    if packed is None or getattr(linear, "panel", None) is None:
        return None
    return _f32(packed, "a panel weight")


class DecodeLayers:
    """A model's decoder layers bound to `kvflow_decode_layers`: the weights' addresses are
    taken once (the tensors are held, so they stay valid)."""

    def __init__(self, lib: ctypes.CDLL, model: Any) -> None:
        spec = model.spec
        self.hidden, self.heads, self.kv_heads = spec.hidden_size, spec.num_heads, spec.num_kv_heads
        self.head_dim, self.inter = spec.head_dim, spec.intermediate_size
        layers = list(model.model.layers)
        norms = [layers[0].input_layernorm]
        held: list[torch.Tensor] = []
        weights: list[int | None] = []
        biases: list[int | None] = []
        panels: list[int | None] = []
        norm_ptrs: list[int | None] = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            for name, linear in (
                ("qkv_proj", attn.qkv_proj),
                ("o_proj", attn.o_proj),
                ("gate_up_proj", mlp.gate_up_proj),
                ("down_proj", mlp.down_proj),
            ):
                w, b = _gemv_weights(linear, f"layer {i} {name}")
                held += [w] if b is None else [w, b]
                weights.append(w.data_ptr())
                biases.append(None if b is None else b.data_ptr())
                packed = _panel_weight(linear)
                if packed is not None:
                    held.append(packed)
                panels.append(None if packed is None else packed.data_ptr())
            after = model.model.norm if i + 1 == len(layers) else layers[i + 1].input_layernorm
            for norm in (layer.post_attention_layernorm, after):
                norms.append(norm)
                held.append(_f32(norm.weight.detach(), "a norm weight"))
                norm_ptrs.append(held[-1].data_ptr())
        eps = {n.eps for n in norms}
        if len(eps) != 1:
            raise ValueError(f"the norms' eps differ: {sorted(eps)}")
        self.eps = eps.pop()
        self.layers = len(layers)
        self._held = held
        self._weights = (_ptr * len(weights))(*weights)
        self._biases = (_ptr * len(biases))(*biases)
        self._norms = (_ptr * len(norm_ptrs))(*norm_ptrs)
        self._panels = (_ptr * len(panels))(*panels) if any(panels) else None
        self.max_rows = PANEL_ROWS if all(panels) else MAX_ROWS
        self._scale = 1.0 / math.sqrt(self.head_dim)
        self._fn = lib.kvflow_decode_layers
        self._fn.restype = None
        self._fn.argtypes = (
            [_ptr, _ptr, _long, _long, _ptr, _ptr, _ptr, _float]
            + [_long] * 5
            + [_ptr, _ptr, _ptr]
            + [_long] * 6
            + [_ptr, _long, _ptr, _ptr, _float]
            + [_ptr] * 6
            + [_long]
        )

    def __call__(
        self, x: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        rows: PagedRows,
    ) -> torch.Tensor:  # fmt: skip
        """x [M, hidden] (the embedded tokens: the residual stream, updated in place) and
        `normed` (its first layer's input norm) through every layer -> the final norm of the
        stream [M, hidden]. cos/sin [M, 1, head_dim] (`Rotary.cos_sin`)."""
        m, hidden, d = x.shape[0], self.hidden, self.head_dim
        pool, table, ranges, slots = rows
        _f32(x, "x")
        h = _f32(normed, "normed")
        if x.shape != (m, hidden) or h.shape != (m, hidden) or not 0 < m <= self.max_rows:
            raise ValueError(f"x and normed must be [1..{self.max_rows}, {hidden}], got {x.shape}")
        for name, t in (("cos", cos), ("sin", sin)):
            if _f32(t, name).shape != (m, 1, d):
                raise ValueError(f"{name} must be [{m}, 1, {d}], got {list(t.shape)}")
        _f32(pool, "the pool")
        if pool.dim() != 6 or tuple(pool.shape[1:4:2]) != (self.layers, self.kv_heads):
            raise ValueError(f"the pool {list(pool.shape)} is not this model's")
        if pool.shape[5] != d or pool.shape[2] != 2:
            raise ValueError(f"the pool {list(pool.shape)} is not this model's")
        if table.dim() != 2:
            raise ValueError("table must be [M, pages]")
        qkv = torch.empty((m, (self.heads + 2 * self.kv_heads) * d))
        attn = torch.empty((m, self.heads * d))
        delta = torch.empty((m, hidden))
        gate_up = torch.empty((m, 2 * self.inter))
        act = torch.empty((m, self.inter))
        self._fn(
            x.data_ptr(), h.data_ptr(), m, self.layers, self._weights, self._biases, self._norms,
            self.eps, hidden, self.heads, self.kv_heads, d, self.inter, cos.data_ptr(),
            sin.data_ptr(), pool.data_ptr(), pool.stride(1), pool.stride(0), pool.stride(2),
            pool.stride(3), pool.stride(4), pool.shape[4],
            _i64(table, (m, table.shape[1]), "table"), table.shape[1],
            _i64(ranges, (m, 2), "ranges"), _i64(slots, (m, 2), "slots"), self._scale,
            qkv.data_ptr(), attn.data_ptr(), delta.data_ptr(), gate_up.data_ptr(),
            act.data_ptr(), self._panels, torch.get_num_threads(),
        )  # fmt: skip
        return h


def decode_enabled() -> bool:
    """`KVFLOW_DECODE` (default on): "0" runs the model's modules one by one."""
    value = os.environ.get(ENV_DECODE, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_DECODE} must be 0 or 1, got {value!r}")
    return value == "1"


def build_decode_layers(model: Any) -> DecodeLayers | None:
    """`model`'s layers bound to the kernel (a `CausalLM` after loading: fused, its linears
    swapped); None where they cannot be (no library, or a layer the kernel does not compute,
    logged once per model)."""
    lib = library()
    if lib is None:
        return None
    try:
        return DecodeLayers(lib, model)
    except ValueError as exc:
        log.info("decode steps run the model's modules one by one: %s", exc)
        return None
