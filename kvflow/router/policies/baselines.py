"""Baseline policies the paper compares against (§4.2, Figure 5): cache-blind choices.

The chosen instance still reuses whatever prefix it holds locally (an engine always does); the
choice just ignores it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvflow.router.policies.base import Policy
from kvflow.router.types import PolicyChoice, PrefillCandidate


class RandomPolicy(Policy):
    """Uniformly random over the candidates, from the conductor's seeded rng."""

    name = "random"

    def choose(self, candidates: Sequence[PrefillCandidate]) -> PolicyChoice:
        return PolicyChoice(self._rng.randrange(len(candidates)))


class RoundRobinPolicy(Policy):
    """Cycles over the candidate positions: the n-th call picks ``n mod len(candidates)``.

    The cursor advances on every call, including calls whose request is then rejected.
    """

    name = "round-robin"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._cursor = 0

    def choose(self, candidates: Sequence[PrefillCandidate]) -> PolicyChoice:
        index = self._cursor % len(candidates)
        self._cursor += 1
        return PolicyChoice(index)


class LeastLoadedPolicy(Policy):
    """Fewest queued requests (the paper's "number of assigned requests"); ties go to the
    lower predicted queue seconds, then to the first candidate."""

    name = "least-loaded"

    def choose(self, candidates: Sequence[PrefillCandidate]) -> PolicyChoice:
        keys = [(c.queued_requests, c.local.t_queue, i) for i, c in enumerate(candidates)]
        return PolicyChoice(min(keys)[2])
