"""The scheduling policy of one engine step: which prefill chunks, which decode batch.

Pure: it reads sequence counters and returns a plan; the engine executes it. Prefill is
first-come first-served within a token budget of `prefill_chunk` per step (chunked prefill);
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


def plan_step(seqs: Iterable[Sequence], prefill_budget: int, max_batch: int) -> StepPlan:
    """Plan one step over the live sequences (given in arrival order)."""
    prefill: list[tuple[Sequence, int]] = []
    decoding: list[Sequence] = []
    budget = prefill_budget
    for seq in seqs:
        phase = seq.phase
        if phase is Phase.PREFILL and budget > 0:
            n = min(seq.remaining, budget)
            prefill.append((seq, n))
            budget -= n
        elif phase is Phase.DECODE:
            decoding.append(seq)
    decoding.sort(key=lambda s: (s.last_decode_step, s.arrival))
    return StepPlan(prefill=tuple(prefill), decode=tuple(decoding[:max_batch]))
