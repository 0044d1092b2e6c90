"""Linears through oneDNN directly on the CPU: bfloat16 (where the CPU computes bf16 natively)
and float32.

With bf16 weights, `nn.Linear` on the CPU goes through aten's matmul, which for the few rows
of a decode step (batch 1-8) ran 1.3-1.9x slower here than oneDNN's inner product on the same
weights (`torch.ops.mkldnn._linear_pointwise`, what torch.compile's CPU backend emits for a
frozen bf16 linear). `use_onednn_linears` swaps every `nn.Linear` of a loaded model for a
`OneDNNLinear` holding the weight prepared by `torch.ops.mkldnn._reorder_linear_weight`.
The outputs are the same (bit for bit on the CPUs measured); docs/performance.md has numbers.

float32: `nn.Linear` goes to MKL, whose matrix-vector product (a decode step at batch 1) read
the weights at ~12 GB/s here on 1 or 2 threads alike, while oneDNN's inner product on the same
float32 weights, unprepared, ran 1.5-1.6x faster on 2 threads (and ~1.1x on 1); prefill-sized
products (512 rows) ran at the same rate. `OneDNNDenseLinear` calls it on the linear's own
weight (no second copy, the parameter names and the tied embedding stay); its outputs equal
`F.linear`'s up to float32 summation order (~1e-5 relative).

float32 decode steps (at most `cpu_gemv.MAX_ROWS` rows, 16) go further, to the matrix-vector
kernel of cpu_gemv.py, which reads the weights at the rate of a plain read (~28 GB/s here
against oneDNN's ~20); prefill chunks stay on a matrix product.

`onednn_applies(dtype, device)` decides where it is used: on the CPU with oneDNN, float32
always, bf16 with oneDNN's bf16 support (avx512_bf16 / AMX or the Arm equivalent).
Everywhere else the model keeps `nn.Linear` (float16, CUDA). `KVFLOW_LINEAR` picks the
backend (the A/B switch of `kvflow.tools.bench.roofline --linears`): "transposed" as "gemv"
with a second copy of each float32 decoder weight, transposed to [in, out] and contiguous,
for products of more than 16 rows, prefill chunks above all: `torch.addmm` on it is MKL's
plain (non-transposed) sgemm, which on an Intel Xeon (AVX-512) ran the decoder's products
3-12% faster than oneDNN on a prepacked weight at 24-1,024 rows (30 layers of distinct
weights, 2 threads; docs/performance.md); "prepacked" as "transposed" with the copy in
oneDNN's blocked layout instead (`_reorder_linear_weight`, what vLLM's CPU backend does for
float32), which on an AMD EPYC (AVX2) ran them 1-65% faster than MKL's sgemm (most at the
fewest rows); "panel" with the copy in panels of 16 outputs (cpu_panel.py), which takes
every row count, decode steps too (cpu_decode.py calls the same kernel): on that AMD EPYC it
ran them faster than the prepacked copy at 1-1,024 rows and than the decode kernel from 2
rows on; "gemv" without the copy (the way out, and the default where the copy would
take more than 1/16 of the memory available); "onednn" without the decode kernel; "aten"
keeps `nn.Linear` everywhere. Unset, the copy's form is `default_copy_form()`: "panel" where
its vector kernel is built (AVX2 + FMA, no AVX-512), else "transposed" on Intel CPUs with
torch's MKL, "prepacked" elsewhere. The copy costs the float32 decoder
linears' weights again (+405 MiB for SmolLM2-135M, per engine); in panels the lm_head's too
(+108 MiB: `copies_lm_head`). The prefill rows' outputs
differ between the backends by float32 rounding only (the order of the sums; ~1e-6
relative). `prepack_planned` is the one place that decides whether the copy is made, for
the engine as it loads and for the server's memory plan (stages/serve/memory.py).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import nn

from kvflow.stages.engine.cpu_gemv import Gemv, gemv_applies, gemv_kernel
from kvflow.stages.engine.cpu_panel import PanelGemm, pack, panel_applies, panel_fast, panel_kernel
from kvflow.stages.engine.linear_swap import swap_linears
from kvflow.stages.engine.meminfo import available_at_start

logger = logging.getLogger(__name__)

ENV_LINEAR = "KVFLOW_LINEAR"
LINEAR_BACKENDS = ("gemv", "onednn", "aten", "prepacked", "transposed", "panel")
COPY_BACKENDS = ("prepacked", "transposed", "panel")
"""The backends that keep a second copy of each float32 decoder weight: for prefill rows
("prepacked", "transposed"), for every row ("panel")."""
PACK_ROWS = 512
"""The rows oneDNN is told to expect when it prepares a float32 weight (the prefill chunk)."""
PREPACK_SHARE = 16
"""By default the prefill copy is made where it takes at most 1/16 of the memory available
(the share one KV pool gets, stages/serve/memory.py)."""


@functools.cache
def cpu_vendor() -> str:
    """`vendor_id` of /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...), or "" where there
    is none (another OS, Arm)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    return value.strip()
    except OSError:
        pass
    return ""


def default_copy_form(vendor: str | None = None, fast_panels: bool | None = None) -> str:
    """The copy's form where `KVFLOW_LINEAR` is unset: "panel" (cpu_panel.py, every row
    count) where its vector kernel is built (`fast_panels`, default `panel_fast()`: AVX2 +
    FMA without AVX-512); else "transposed" (MKL's sgemm) on an Intel CPU (`vendor`, default
    `cpu_vendor()`) with torch's MKL, "prepacked" (oneDNN) on every other CPU, where MKL's
    products were the slower: measured on one Intel Xeon (AVX-512) and one AMD EPYC (AVX2;
    docs/performance.md)."""
    if panel_fast() if fast_panels is None else fast_panels:
        return "panel"
    vendor = cpu_vendor() if vendor is None else vendor
    if vendor == "GenuineIntel" and torch.backends.mkl.is_available():
        return "transposed"
    return "prepacked"


def linear_backend() -> str:
    """`KVFLOW_LINEAR` (default `default_copy_form()`, which `prepack_planned` turns into
    "gemv" where the copy does not fit): "transposed" or "prepacked" with a copy for prefill
    rows, "gemv" without a copy, "onednn" without the decode kernel either, "aten" keeps
    `nn.Linear` for every dtype."""
    value = os.environ.get(ENV_LINEAR) or default_copy_form()
    if value not in LINEAR_BACKENDS:
        raise ValueError(f"{ENV_LINEAR} must be one of {LINEAR_BACKENDS}, got {value!r}")
    return value


def prepack_planned(dtype: str, copy_bytes: int, available: int | None) -> bool:
    """Whether a `dtype` engine on the CPU keeps a copy of `copy_bytes` (`copied_params`: its
    float32 decoder linears' weights, with panels the lm_head's too), with `available` bytes
    of memory (None: unknown). The one place that decides, for the engine
    (`use_onednn_linears`) and the server's memory plan: float32 only; `KVFLOW_LINEAR` set to
    a copy backend (`COPY_BACKENDS`) always, another value never; unset, where the copy takes
    at most 1/`PREPACK_SHARE` of `available`."""
    if dtype != "float32":
        return False
    backend = linear_backend()
    if ENV_LINEAR in os.environ:
        return backend in COPY_BACKENDS
    return available is None or copy_bytes * PREPACK_SHARE <= available


def onednn_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `use_onednn_linears` is used for a model in `dtype` on `device`."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if linear_backend() == "aten":
        return False
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without these oneDNN ops
        return False


class OneDNNLinear(nn.Module):
    """`y = x @ W.T + b` for 2-D bf16 `x` with W prepared for oneDNN once. The prepared weight
    is a buffer (`packed`); `weight` is not kept unless it is shared (tied embeddings)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.register_buffer("packed", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


class OneDNNDenseLinear(nn.Module):
    """`y = x @ W.T + b` for 2-D float32 `x` through oneDNN's inner product on the linear's
    own (unprepared) weight, which stays a parameter under its name; with `gemv` (cpu_gemv.py),
    a few rows (a decode step) go to that kernel instead. `copy` ("transposed" or
    "prepacked", see `COPY_BACKENDS`): the other rows go to a second copy of the weight,
    transposed for MKL's sgemm or prepared for oneDNN."""

    def __init__(
        self,
        linear: nn.Linear,
        gemv: Gemv | None = None,
        copy: str | None = None,
        panel: PanelGemm | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.gemv = gemv
        self.panel = panel
        if copy is not None and copy not in COPY_BACKENDS:
            raise ValueError(f"copy must be one of {COPY_BACKENDS} or None, got {copy!r}")
        if copy == "panel" and panel is None:
            raise ValueError("copy='panel' needs the panel kernel")
        self.copy = copy
        self.prefill_weight: torch.Tensor | None
        self.transposed_weight: torch.Tensor | None
        self.panel_weight: torch.Tensor | None
        self.refresh()

    def refresh(self) -> None:
        """(Re)make the copy from `weight`: at construction, and after the weight was
        changed in place (the copy does not follow it)."""
        weight = self.weight.detach()
        packed = transposed = panels = None
        if self.copy == "prepacked":  # oneDNN's blocked layout
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        elif self.copy == "transposed":  # [in, out], contiguous: x @ it is a plain sgemm
            transposed = weight.t().contiguous()
        elif self.copy == "panel":  # panels of 16 outputs, for every row count
            panels = pack(weight)
        self.register_buffer("prefill_weight", packed, persistent=False)
        self.register_buffer("transposed_weight", transposed, persistent=False)
        self.register_buffer("panel_weight", panels, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        panels = self.panel_weight
        if panels is not None and self.panel is not None and panel_applies(x, panels):
            return self.panel(x, panels, self.bias, self.out_features)
        if self.gemv is not None and gemv_applies(x, self.weight):
            return self.gemv(x, self.weight, self.bias)
        transposed = self.transposed_weight
        if transposed is not None and x.dim() == 2:
            if self.bias is None:
                return torch.mm(x, transposed)
            return torch.addmm(self.bias, x, transposed)
        weight = self.weight if self.prefill_weight is None else self.prefill_weight
        return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")

    @property
    def has_copy(self) -> bool:
        """Whether rows run on a second copy of the weight (any form)."""
        return any(
            w is not None for w in (self.prefill_weight, self.transposed_weight, self.panel_weight)
        )

    def extra_repr(self) -> str:
        kind = "onednn dense" + (", gemv" if self.gemv is not None else "")
        kind += ", prepacked" if self.prefill_weight is not None else ""
        kind += ", transposed" if self.transposed_weight is not None else ""
        kind += ", panel" if self.panel_weight is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


def _onednn(linear: nn.Linear, packed: frozenset[int]) -> nn.Module:
    if linear.weight.dtype == torch.float32:
        backend = linear_backend()
        gemv = gemv_kernel() if backend in ("gemv", *COPY_BACKENDS) else None
        copy = None
        if id(linear) in packed:  # planned: the backend asked for, or the default's form
            copy = copy_form()
        panel = panel_kernel() if copy == "panel" else None
        return OneDNNDenseLinear(linear, gemv, copy, panel)
    return OneDNNLinear(linear)


def copy_form() -> str:
    """The form of the second copy where one is made: the backend asked for
    (`KVFLOW_LINEAR`), else `default_copy_form()`; "prepacked" (oneDNN's) for panels where
    the kernel library cannot be built or loaded here."""
    backend = linear_backend()
    form = backend if backend in COPY_BACKENDS else default_copy_form()
    return "prepacked" if form == "panel" and panel_kernel() is None else form


def copies_lm_head(form: str) -> bool:
    """Whether a copy of `form` includes the lm_head's weight (the vocabulary, again:
    +108 MiB for SmolLM2-135M). Panels only: they take every row count, and a decode batch
    computes one lm_head row per sequence, up to ``--max-batch``. On the unprepared weight
    (cpu_gemv's kernel up to 16 rows, oneDNN above) those products ran 1.2-1.6x slower than
    on panels at 8-64 rows on a 2-core AMD EPYC (about the same at 1), and decode steps of
    8-64 rows took 5-13 ms more (docs/performance.md "The lm_head on panels"). The prefill
    copies serve prompt rows only, and a prompt computes one lm_head row (its last)."""
    return form == "panel"


def copied_params(linear_params: int, head_params: int) -> int:
    """The weights a float32 engine's copy holds: the decoder linears' (`linear_params`,
    `ModelSpec.linear_params`) and, where `copies_lm_head`, the lm_head's (`head_params`,
    vocabulary x hidden). What `prepack_planned` weighs for the engine and the server's
    memory plan alike."""
    return linear_params + (head_params if copies_lm_head(copy_form()) else 0)


def prepack_candidates(model: nn.Module) -> list[nn.Linear]:
    """The float32 linears that would get a copy: the decoder's, and the lm_head where
    `copies_lm_head` (and only beside them: an int8/int4 model's float32 lm_head alone gets
    none, as its memory plan has no copy)."""
    lm_head = getattr(model, "lm_head", None)
    chosen = [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear) and m is not lm_head and m.weight.dtype == torch.float32
    ]
    head_too = isinstance(lm_head, nn.Linear) and lm_head.weight.dtype == torch.float32
    if chosen and head_too and copies_lm_head(copy_form()):
        chosen.append(lm_head)
    return chosen


def use_onednn_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` under `model` by its oneDNN form (after loading, fusing and
    moving): float32 by a `OneDNNDenseLinear` (same parameters; with the decode kernel under
    the "gemv", "transposed" and "prepacked" backends, and the prefill copy where
    `prepack_planned` says), bf16 by a `OneDNNLinear` (the state dict's names no longer hold
    the weights). Returns the count."""
    candidates = prepack_candidates(model)
    copy_bytes = sum(m.weight.numel() * m.weight.element_size() for m in candidates)
    packed: frozenset[int] = frozenset()
    if candidates:
        available = None if ENV_LINEAR in os.environ else available_at_start()
        if prepack_planned("float32", copy_bytes, available):
            packed = frozenset(id(m) for m in candidates)
        elif linear_backend() in COPY_BACKENDS:  # the default, but the copy does not fit
            logger.info(
                "no prefill copy of the float32 weights: %d MiB, more than 1/%d of the %s MiB "
                "available",
                copy_bytes >> 20, PREPACK_SHARE, "?" if available is None else available >> 20,
            )  # fmt: skip
    return swap_linears(model, lambda linear: _onednn(linear, packed))
