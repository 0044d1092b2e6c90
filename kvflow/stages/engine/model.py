"""The Llama-architecture decoder as a torch module, independent of how KV is stored.

Parameter names equal the Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...),
so a checkpoint loads with `load_state_dict`. Attention is delegated to a `KVAttention`
backend passed to `forward`: the backend stores the new K/V and attends over the stored
context (paged pool for serving, a contiguous cache for the plain reference path).

After loading, `CausalLM.fuse_projections()` concatenates q/k/v and gate/up into one weight
each (one matmul instead of three and two: fewer passes over the activations and fewer ops
per token); the HF names are what a checkpoint loads into, the fused modules what runs.

On the CPU in float32 the elementwise steps between the matmuls (the residual add with the
next RMSNorm, RoPE, SiLU(gate) * up) run as fused kernels (cpu_fused.py), decided once per
forward; elsewhere, and with `KVFLOW_FUSED=0`, the torch ops below compute the same values.

Tokens are flattened: `forward` takes T tokens ([T] ids, [T] positions) that may belong to
one request (a prefill chunk) or to T requests (one decode step each); the backend knows which.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.stages.engine.cpu_decode import DecodeLayers, build_decode_layers, decode_enabled
from kvflow.stages.engine.cpu_fused import FusedKernels, fused_kernels
from kvflow.stages.engine.rope import Rotary, apply_rotary
from kvflow.stages.engine.spec import ModelSpec


class KVAttention(Protocol):
    """Stores one layer's new K/V and attends over the context it belongs to."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] (RoPE applied)
        -> [T, heads * head_dim]. Mutates the backend's KV storage."""
        ...


# A backend may also offer `paged_rows() -> cpu_decode.PagedRows | None`: a decode batch over a
# float32 CPU page pool, whose layers then run in one call (cpu_decode.py).


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 == self.weight.dtype:  # one op, bit-identical (tested)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # transformers' h * rsqrt(mean(h^2) + eps) in float32, as one op (bit-identical on
        # the CPU, within one half-precision rounding on a GPU: both tested): three kernels
        # fewer a norm on a GPU, where decode is launch-bound
        h = F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=spec.o_bias)
        self.qkv_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """Replace q/k/v_proj by one qkv_proj (rows q, then k, then v)."""
        self.qkv_proj = _fused((self.q_proj, self.k_proj, self.v_proj))
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVAttention,
        fused: FusedKernels | None = None,
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None:  # q and k rotate as one [T, heads + kv_heads, d] block
            qkv = self.qkv_proj(x)
            qk2, v2 = qkv.split(((heads + kv_heads) * d, kv_heads * d), dim=-1)
            qk = _rotate(qk2.unflatten(-1, (heads + kv_heads, d)), cos, sin, fused)
            q, k = qk.split((heads, kv_heads), dim=1)
        else:
            q2, k2, v2 = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = _rotate(q2.view(t, heads, d), cos, sin, fused)
            k = _rotate(k2.view(t, kv_heads, d), cos, sin, fused)
        v = v2.view(t, kv_heads, d)
        return self.o_proj(kv.attend(self.layer, q, k, v))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, i, b = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """Replace gate_proj and up_proj by one gate_up_proj (rows gate, then up)."""
        self.gate_up_proj = _fused((self.gate_proj, self.up_proj))
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, fused: FusedKernels | None = None) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if fused is not None:
                return self.down_proj(fused.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: FusedKernels | None
) -> torch.Tensor:
    """RoPE on x [T, heads, d]: in place by the kernel, else `apply_rotary` (a new tensor)."""
    if fused is not None:
        return fused.rope_(x, cos, sin)
    return apply_rotary(x, cos, sin)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, fused: FusedKernels | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream x plus delta (None: nothing added) and `norm` of it. The kernel
    adds in place; torch computes x + delta, a new tensor."""
    if fused is not None:
        return fused.add_rms_norm(x, delta, norm.weight, norm.eps)
    if delta is not None:
        x = x + delta
    return x, norm(x)


def _fused(parts: tuple[nn.Linear, ...]) -> nn.Linear:
    """One Linear whose output is the concatenation of `parts`' outputs (same input)."""
    weight = torch.cat([p.weight for p in parts], dim=0)
    fused = nn.Linear(
        weight.shape[1], weight.shape[0], bias=parts[0].bias is not None, device="meta"
    )
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if parts[0].bias is not None:
        bias = torch.cat([p.bias for p in parts if p.bias is not None])
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVAttention,
        next_norm: RMSNorm,
        fused: FusedKernels | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream entering the layer, `normed` its input_layernorm. Returns
        the stream leaving it and `next_norm` of that (the next layer's input_layernorm, or
        the final norm): each residual add is fused with the norm that follows it."""
        x, h = add_rms_norm(
            x, self.self_attn(normed, cos, sin, kv, fused), self.post_attention_layernorm, fused
        )
        return add_rms_norm(x, self.mlp(h, fused), next_norm, fused)


class DecoderStack(nn.Module):
    """`model.*` in the HF checkpoint: embeddings, layers, final norm."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama/Mistral/Qwen2 causal LM. Not thread-safe only through its KV backends; the
    module itself is read-only after loading."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderStack(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary: Rotary | None = None
        self._decode: list[DecodeLayers | None] = []  # bound at the first decode step

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up in every layer (call once, after the weights are loaded).
        The outputs are the same columns the separate projections computed."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self._decode.clear()

    def setup_rotary(self, device: torch.device) -> None:
        """Build the RoPE tables on `device`; call once after the weights are in place."""
        self.rotary = Rotary(self.spec.rope, self.spec.head_dim, device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVAttention
    ) -> torch.Tensor:
        """input_ids, positions int64 [T] -> final hidden states [T, hidden] (normed)."""
        if self.rotary is None:
            raise RuntimeError("CausalLM.setup_rotary() was not called")
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        fused = fused_kernels(x)
        layers = self.model.layers
        x, h = add_rms_norm(x, None, layers[0].input_layernorm, fused)
        paged_rows = getattr(kv, "paged_rows", None)
        if fused is not None and paged_rows is not None and decode_enabled():
            if not self._decode:
                self._decode.append(build_decode_layers(self))
            decode = self._decode[0]
            if decode is not None and x.shape[0] <= decode.max_rows:
                rows = paged_rows()
                if rows is not None:
                    return decode(x, h, cos, sin, rows)
        for i, layer in enumerate(layers):
            last = i + 1 == len(layers)
            next_norm = self.model.norm if last else layers[i + 1].input_layernorm
            x, h = layer(x, h, cos, sin, kv, next_norm, fused)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).to(torch.float32)
