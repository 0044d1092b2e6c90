"""bfloat16 linears through oneDNN directly, on CPUs that compute bf16 natively.

With bf16 weights, `nn.Linear` on the CPU goes through aten's matmul, which for the few rows
of a decode step (batch 1-8) ran 1.3-1.9x slower here than oneDNN's inner product on the same
weights (`torch.ops.mkldnn._linear_pointwise`, what torch.compile's CPU backend emits for a
frozen bf16 linear). `use_onednn_linears` swaps every `nn.Linear` of a loaded model for a
`OneDNNLinear` holding the weight prepared by `torch.ops.mkldnn._reorder_linear_weight`.
The outputs are the same (bit for bit on the CPUs measured); docs/performance.md has numbers.

`onednn_applies(dtype, device)` decides where it is used: bf16, on the CPU, with oneDNN's
bf16 support (avx512_bf16 / AMX or the Arm equivalent). Everywhere else the model keeps
`nn.Linear` (float32, float16, CUDA).
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `use_onednn_linears` is used for a model in `dtype` on `device`."""
    if dtype != torch.bfloat16 or device.type != "cpu" or not torch.backends.mkldnn.is_available():
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


def use_onednn_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` under `model` by a `OneDNNLinear` (after loading, fusing
    and moving; the state dict's names no longer hold the weights). Returns the count."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, OneDNNLinear(child))
    return len(swaps)
