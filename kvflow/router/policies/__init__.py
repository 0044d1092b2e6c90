"""Routing policies, picked by name: cache-aware (Algorithm 1), local-cache-aware, random,
round-robin, least-loaded."""

from __future__ import annotations

from kvflow.router.policies.base import Policy
from kvflow.router.policies.baselines import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from kvflow.router.policies.cache_aware import CacheAwarePolicy, LocalCacheAwarePolicy
from kvflow.router.policies.registry import POLICIES, make_policy, policy_names

__all__ = [
    "POLICIES",
    "CacheAwarePolicy",
    "LeastLoadedPolicy",
    "LocalCacheAwarePolicy",
    "Policy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "make_policy",
    "policy_names",
]
