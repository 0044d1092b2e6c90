"""`swap_linears(model, make)`: every `nn.Linear` under a model replaced by another module built
from it — the one walk that the oneDNN linears (onednn_linear.py) and the weight-only quantized
linears (quant_linear.py) share."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every `nn.Linear` under `model` by `make(linear)`, in `model.modules()` order
    (all found before the first is replaced). Returns the count."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)
