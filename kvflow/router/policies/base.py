"""The contract every routing policy implements.

A policy only computes a choice over the conductor's per-instance predictions; it reads no
instance state and mutates nothing but its own small cursor (round-robin) or the rng it is
given. Every implementation is constructed the same way: ``Policy(rng)``.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import ClassVar

from kvflow.router.types import PolicyChoice, PrefillCandidate


class Policy(abc.ABC):
    """Picks the prefill instance for one request.

    ``choose`` receives a non-empty sequence of candidates (healthy prefill instances, in the
    caller's order) and returns a :class:`PolicyChoice` whose ``index`` is valid for it. Not
    thread-safe: the conductor calls it under its own lock.
    """

    name: ClassVar[str]
    # True when the policy weighs where a request's cached blocks are, and so decides whether
    # they are pulled (``PolicyChoice.pull``): a prefill instance then pulls exactly the
    # decision's ``PullPlan`` and nothing more. False (cache-blind baselines): the instance may
    # read any continuation of its local prefix that another instance holds.
    decides_pulls: ClassVar[bool] = False

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    @abc.abstractmethod
    def choose(self, candidates: Sequence[PrefillCandidate]) -> PolicyChoice:
        """The choice; never called with an empty sequence."""


def argmin(values: Sequence[float]) -> int:
    """Index of the smallest value; the first one on ties (the paper's strict ``>`` test)."""
    best = 0
    for i in range(1, len(values)):
        if values[i] < values[best]:
            best = i
    return best
