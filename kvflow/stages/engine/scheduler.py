"""The scheduling policy of one engine step: which prefill chunks, which decode batch.

Pure: it reads sequence counters and returns a plan; the engine executes it. Prefill is
first-come first-served within a token budget of `prefill_chunk` per step (chunked prefill);
decode takes up to `max_batch` sequences, least recently decoded first, so a batch larger
than the cap rotates fairly. Requests join and leave the decode batch between steps.

While requests decode in the same engine (a colocated server), a step's prefill budget is
`mixed_budget` instead: the step's time is every running stream's time between tokens, so a
smaller chunk bounds it, and a lone prompt still gets the full chunk (and every core).
While more than one prompt waits (``queued_budget`` given: a fixed mixed budget, not one
sized by time), the step takes up to ``queued_budget`` prompt tokens even beside streams:
the prefill work is the same either way, but each step beside streams also computes their
decode batch, so fewer, larger steps answer a queue of prompts sooner (measured on 2 cores,
docs/performance.md "A queue of prompts beside running streams"). One long prompt beside
streams still gets ``mixed_budget``.

A prompt whose rest exceeds the budget by at most `tail_slack(budget)` tokens (1/8 of it)
takes the rest in this chunk: a 513-token prompt under a 512-token budget would otherwise pay
a whole second forward pass (every weight read again, ~0.09 s here for one token,
docs/performance.md "Cold TTFT") before its first token. Beside running streams too (their
step grows by at most 1/8; the step the tail would have cost them is a plain decode step
instead): four 257-token prompts under a 1,024-token queue budget would otherwise leave
4 tokens of the last for one more step before its first token (measured in the 8-client
row). Only a budget sized by a step-time target (``timed``) stays exact beside streams.

A fixed budget beside streams counts the step's decode rows: the prompt tokens and the decode
rows together fill it (as a token budget per step counts both in vLLM), down to half of it at
most. The linears run every row of a step as one matrix, and oneDNN's float32 product on 2
threads costs about as much for 996-1,024 rows as for 1,024 and steps up past 1,024 (~3% more
per row, +35 ms a step for a single extra row: docs/performance.md "A step's rows fill its
budget"); a budget sized by time already includes the decode batch's cost.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvflow.stages.engine.sequence import Phase, Sequence

TAIL_SLACK_DIVISOR = 8


def tail_slack(budget: int) -> int:
    """How many tokens past ``budget`` a lone prompt's last chunk may take (1/8 of it)."""
    return budget // TAIL_SLACK_DIVISOR


@dataclass(frozen=True)
class StepPlan:
    """prefill: (sequence, number of tokens to compute) in order; decode: one token each."""

    prefill: tuple[tuple[Sequence, int], ...]
    decode: tuple[Sequence, ...]

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


def plan_step(
    seqs: Iterable[Sequence],
    prefill_budget: int,
    max_batch: int,
    mixed_budget: int | None = None,
    queued_budget: int | None = None,
    timed: bool = False,
) -> StepPlan:
    """Plan one step over the live sequences (given in arrival order). ``mixed_budget``:
    the prefill budget of a step that also decodes (None: ``prefill_budget``);
    ``queued_budget``: instead, while more than one prompt waits (None: ``mixed_budget``);
    ``timed``: ``mixed_budget`` was sized by a step-time target, so a step beside streams
    takes no tail slack."""
    prefill: list[tuple[Sequence, int]] = []
    waiting: list[Sequence] = []
    decoding: list[Sequence] = []
    for seq in seqs:
        phase = seq.phase
        if phase is Phase.PREFILL:
            waiting.append(seq)
        elif phase is Phase.DECODE:
            decoding.append(seq)
    budget = prefill_budget
    if decoding and mixed_budget is not None:
        queued = queued_budget is not None and len(waiting) > 1
        budget = min(budget, queued_budget if queued else mixed_budget)
    decode = min(len(decoding), max_batch)  # the step's decode rows
    if decode and not timed:
        budget -= min(decode, budget // 2)
    slack = 0 if decoding and timed else tail_slack(budget)
    for seq in waiting:
        if budget <= 0:
            break
        n = seq.remaining if seq.remaining <= budget + slack else budget
        prefill.append((seq, n))
        budget -= n
    decoding.sort(key=lambda s: (s.last_decode_step, s.arrival))
    return StepPlan(prefill=tuple(prefill), decode=tuple(decoding[:decode]))
