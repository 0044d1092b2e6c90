"""Baseline policies the paper compares against (§4.2, Figure 5): cache-blind choices.

The chosen instance still reuses whatever prefix it holds locally (an engine always does); the
choice just ignores it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

from kvflow.router.candidates import PrefillTable, argmin_array
from kvflow.router.policies.base import Policy, argmin
from kvflow.router.types import PolicyChoice, PrefillCandidate


class RandomPolicy(Policy):
    """Uniformly random over the candidates, from the conductor's seeded rng."""

    name = "random"

    def choose(self, table: PrefillTable, tie_break: int = 0) -> PolicyChoice:
        return PolicyChoice(self._rng.randrange(len(table)))

    def reference_choose(
        self, candidates: Sequence[PrefillCandidate], tie_break: int = 0
    ) -> PolicyChoice:
        return PolicyChoice(self._rng.randrange(len(candidates)))


class RoundRobinPolicy(Policy):
    """Cycles over the candidate positions: the n-th call picks ``n mod len(candidates)``.

    The cursor advances on every call, including calls whose request is then rejected.
    """

    name = "round-robin"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._cursor = 0

    def choose(self, table: PrefillTable, tie_break: int = 0) -> PolicyChoice:
        return self._next(len(table))

    def reference_choose(
        self, candidates: Sequence[PrefillCandidate], tie_break: int = 0
    ) -> PolicyChoice:
        return self._next(len(candidates))

    def _next(self, count: int) -> PolicyChoice:
        index = self._cursor % count
        self._cursor += 1
        return PolicyChoice(index)


class LeastLoadedPolicy(Policy):
    """Fewest queued requests (the paper's "number of assigned requests"); ties go to the
    lower predicted queue seconds, then by ``tie_break`` among what is still tied."""

    name = "least-loaded"

    def choose(self, table: PrefillTable, tie_break: int = 0) -> PolicyChoice:
        queued = table.queued_requests
        # queued seconds of the least-queued ones; the rest are out of the running
        seconds = np.where(queued == queued.min(), table.t_queue, np.inf)
        return PolicyChoice(argmin_array(seconds, tie_break))

    def reference_choose(
        self, candidates: Sequence[PrefillCandidate], tie_break: int = 0
    ) -> PolicyChoice:
        fewest = min(c.queued_requests for c in candidates)
        seconds = [c.local.t_queue if c.queued_requests == fewest else math.inf for c in candidates]
        return PolicyChoice(argmin(seconds, tie_break))
