"""The contract every routing policy implements.

A policy only computes a choice over the conductor's per-instance predictions; it reads no
instance state and mutates nothing but its own small cursor (round-robin) or the rng it is
given. Every implementation is constructed the same way: ``Policy(rng)``.

Two forms of the same choice: :meth:`Policy.choose` over a :class:`PrefillTable` (arrays, what
the conductor calls) and :meth:`Policy.reference_choose` over per-instance
:class:`PrefillCandidate` records (the straightforward form the reference conductor calls; tests
check that both pick the same instance).
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import ClassVar

from kvflow.router.candidates import PrefillTable
from kvflow.router.types import PolicyChoice, PrefillCandidate


class Policy(abc.ABC):
    """Picks the prefill instance for one request.

    ``choose`` receives a non-empty table (healthy prefill instances, in the caller's order) and
    returns a :class:`PolicyChoice` whose ``index`` is valid for it; ``reference_choose`` makes
    the same choice from the rows as records. Not thread-safe: the conductor calls it under its
    own lock.
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
    def choose(self, table: PrefillTable, tie_break: int = 0) -> PolicyChoice:
        """The choice; never called with an empty table. ``tie_break`` (a hash of the request
        id) picks among exactly tied candidates, see :func:`argmin`."""

    @abc.abstractmethod
    def reference_choose(
        self, candidates: Sequence[PrefillCandidate], tie_break: int = 0
    ) -> PolicyChoice:
        """:meth:`choose` over the same rows as records, written per instance."""


def argmin(values: Sequence[float], tie_break: int = 0) -> int:
    """Index of the smallest value. Exact ties go to the ``tie_break mod ties``-th tied index:
    the conductor passes a hash of the request id, so ties spread evenly over the tied instances
    (an idle cluster's load no longer piles on the first instance) while a decision stays a pure
    function of the request and the state. ``tie_break=0`` picks the first."""
    best = 0
    tied = 1
    for i in range(1, len(values)):
        if values[i] < values[best]:
            best = i
            tied = 1
        elif values[i] == values[best]:
            tied += 1
    if tied == 1:
        return best
    low = values[best]
    pick = tie_break % tied
    for i in range(best, len(values)):
        if values[i] == low:
            if pick == 0:
                return i
            pick -= 1
    raise AssertionError("unreachable: tie count out of step")
