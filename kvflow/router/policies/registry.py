"""Policies by name. Adding a policy = one class with a ``name`` plus one entry below."""

from __future__ import annotations

import random

from kvflow.router.errors import UnknownPolicyError
from kvflow.router.policies.base import Policy
from kvflow.router.policies.baselines import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from kvflow.router.policies.cache_aware import CacheAwarePolicy, LocalCacheAwarePolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        CacheAwarePolicy,
        LocalCacheAwarePolicy,
        RandomPolicy,
        RoundRobinPolicy,
        LeastLoadedPolicy,
    )
}


def policy_names() -> tuple[str, ...]:
    """Registered names, in registration order (the cache-aware default first)."""
    return tuple(POLICIES)


def make_policy(name: str, rng: random.Random) -> Policy:
    """A new policy instance; UnknownPolicyError (a ValueError) lists the known names."""
    cls = POLICIES.get(name)
    if cls is None:
        raise UnknownPolicyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return cls(rng)
