"""Cache-aware policies: the conductor's Algorithm 1 (with cache load balancing) and §4.1's local
variant (the same TTFT estimate, without pulling blocks from another instance)."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.router.candidates import PrefillTable, argmin_array
from kvflow.router.policies.base import Policy, argmin
from kvflow.router.types import PolicyChoice, PrefillCandidate

_new = object.__new__


class CacheAwarePolicy(Policy):
    """Lowest predicted TTFT over the balanced options (pulls the best match when it pays);
    exact ties spread by ``tie_break``."""

    name = "cache-aware"
    decides_pulls = True

    def choose(self, table: PrefillTable, tie_break: int = 0) -> PolicyChoice:
        index = argmin_array(table.balanced_ttft, tie_break)
        choice = _new(PolicyChoice)  # the frozen dataclass without its __init__'s setattrs
        choice.__dict__.update(index=index, pull=table.pulls(index))
        return choice

    def reference_choose(
        self, candidates: Sequence[PrefillCandidate], tie_break: int = 0
    ) -> PolicyChoice:
        index = argmin([c.balanced.ttft for c in candidates], tie_break)
        return PolicyChoice(index, pull=candidates[index].balanced.pull_blocks > 0)


class LocalCacheAwarePolicy(Policy):
    """Lowest predicted TTFT reusing only each instance's own prefix (no remote pulls)."""

    name = "local-cache-aware"
    decides_pulls = True

    def choose(self, table: PrefillTable, tie_break: int = 0) -> PolicyChoice:
        return PolicyChoice(argmin_array(table.local_ttft, tie_break))

    def reference_choose(
        self, candidates: Sequence[PrefillCandidate], tie_break: int = 0
    ) -> PolicyChoice:
        return PolicyChoice(argmin([c.local.ttft for c in candidates], tie_break))
