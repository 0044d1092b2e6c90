"""The scheduling policy of one engine step: which prefill chunks, which decode batch.

Pure: it reads sequence counters and returns a plan; the engine executes it. Prefill is
first-come first-served within a token budget of `prefill_chunk` per step (chunked prefill),
except that while no request is decoding, the first request in prefill may take up to
`idle_chunk` tokens in one step: a lone long prompt runs in fewer, larger forwards (its first
chunk's attention needs no gather and no mask, docs/performance.md), and no running stream
waits behind it. The requests after it wait for it either way (first come, first served);
decode takes up to `max_batch` sequences, least recently decoded first, so a batch larger
than the cap rotates fairly. Requests join and leave the decode batch between steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvflow.stages.engine.sequence import Phase, Sequence


@dataclass(frozen=True)
class StepPlan:
    """prefill: (sequence, number of tokens to compute) in order; decode: one token each."""

    prefill: tuple[tuple[Sequence, int], ...]
    decode: tuple[Sequence, ...]

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


def plan_step(
    seqs: Iterable[Sequence], prefill_budget: int, max_batch: int, idle_chunk: int = 0
) -> StepPlan:
    """Plan one step over the live sequences (given in arrival order). ``idle_chunk``: the
    most tokens the first prefilling request computes when no request decodes (at least
    ``prefill_budget``; 0 or less keeps ``prefill_budget``)."""
    live = list(seqs)
    prefill: list[tuple[Sequence, int]] = []
    decoding = [s for s in live if s.phase is Phase.DECODE]
    first_cap = prefill_budget if decoding else max(prefill_budget, idle_chunk)
    budget = prefill_budget
    for seq in live:
        if seq.phase is Phase.PREFILL and budget > 0:
            n = min(seq.remaining, budget if prefill else first_cap)
            prefill.append((seq, n))
            budget -= n
    decoding.sort(key=lambda s: (s.last_decode_step, s.arrival))
    return StepPlan(prefill=tuple(prefill), decode=tuple(decoding[:max_batch]))
