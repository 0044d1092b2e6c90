"""Token sampling: greedy, or temperature with top-k / top-p, seeded per request."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.stages.engine.config import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of float32 logits [N, vocab]. Greedy rows take the argmax (ties to
    the lowest id); others sample with their own generator, which advances. Pure otherwise."""
    safe = torch.nan_to_num(logits.to(torch.float32), nan=float("-inf"))
    tokens = safe.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[row] = _sample_row(safe[row], p, gen, fallback=int(tokens[row]))
    return [int(t) for t in tokens]


def _sample_row(
    logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None, fallback: int
) -> int:
    """One sampled token; ``fallback`` (the argmax) when the distribution is not finite, so
    one row can never fail the rows sampled beside it."""
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = (cum - sorted_logits.softmax(-1)) >= p.top_p  # keeps at least the top token
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(-1)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        return fallback
    return int(torch.multinomial(probs, 1, generator=gen).item())
