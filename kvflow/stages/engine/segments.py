"""Segments: one forward pass over the work of several requests at once.

A step may hold prefill chunks of some requests and one decode token of others. Their linear
layers (nearly all of the FLOPs and every weight read) do not care which request a row
belongs to, so the rows are stacked and run through the model once; only attention differs
per request. `Segments` is a `KVAttention` backend that splits each layer's rows by segment
and hands each slice to that segment's own backend (a `PagedPrefill` chunk, a `PagedDecode`
batch), then stacks the outputs back in row order.

Each row is computed from its own request's KV only, so a mixed step produces what the same
work run as separate forwards would, up to float rounding of the larger matrix products.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.stages.engine.model import KVAttention


class Segments:
    """Consecutive row ranges, each with its own backend: ``parts`` is (rows, backend) in
    row order. Built for one forward pass; not thread-safe."""

    def __init__(self, parts: Sequence[tuple[int, KVAttention]]) -> None:
        if not parts or any(rows < 1 for rows, _ in parts):
            raise ValueError("Segments needs at least one part of at least one row")
        self.parts = list(parts)
        self.rows = [rows for rows, _ in parts]
        self.num_rows = sum(self.rows)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.num_rows:
            raise ValueError(f"Segments: {q.shape[0]} rows, the parts cover {self.num_rows}")
        outs = [
            backend.attend(layer, qs, ks, vs)
            for (_, backend), qs, ks, vs in zip(
                self.parts,
                q.split(self.rows),
                k.split(self.rows),
                v.split(self.rows),
                strict=True,
            )
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
