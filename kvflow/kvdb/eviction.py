"""Eviction: policies that only compute a priority and an action, and the victim selection
mechanism that applies a policy to one tier's blocks.

Policies are pure, stateless and picked by name from ``POLICIES``. Lower priority = evicted
first; ties are broken by key bytes so the order is deterministic.
"""

from __future__ import annotations

import abc
import enum
import heapq
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from kvflow.kvdb.keys import BlockKey

logger = logging.getLogger(__name__)


class EvictAction(enum.Enum):
    """What happens to a victim: moved to the tier below, or dropped from this node."""

    DEMOTE = "demote"
    DROP = "drop"


@dataclass(frozen=True)
class Candidate:
    """What a policy may look at. ``last_access`` is a logical clock (larger = more recent);
    ``replicas`` counts copies on every node, this one included."""

    key: BlockKey
    last_access: int
    replicas: int
    nbytes: int


class EvictionPolicy(abc.ABC):
    """A priority over candidates; ``leaves_first`` asks the mechanism to consider a block only
    once none of its children is left in the tier (child before parent)."""

    name: ClassVar[str]
    leaves_first: ClassVar[bool]

    @abc.abstractmethod
    def priority(self, candidate: Candidate) -> tuple[int, ...]:
        """Sort key; the smallest is evicted first."""

    @abc.abstractmethod
    def action(self, candidate: Candidate, can_demote: bool) -> EvictAction:
        """DEMOTE or DROP this victim (``can_demote`` is False on the lowest tier)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first, blind to prefixes and replicas; demotes whenever it can."""

    name = "lru"
    leaves_first = False

    def priority(self, candidate: Candidate) -> tuple[int, ...]:
        return (candidate.last_access,)

    def action(self, candidate: Candidate, can_demote: bool) -> EvictAction:
        return EvictAction.DEMOTE if can_demote else EvictAction.DROP


class PrefixReplicaLRUPolicy(EvictionPolicy):
    """The default. A child goes before its parent (leaves first); among leaves, a block with
    replicas elsewhere goes before a last copy, then least recently used. A block with replicas
    elsewhere is dropped; a last copy is demoted rather than dropped (dropped only from the
    lowest tier)."""

    name = "prefix_replica_lru"
    leaves_first = True

    def priority(self, candidate: Candidate) -> tuple[int, ...]:
        return (0 if candidate.replicas > 1 else 1, candidate.last_access)

    def action(self, candidate: Candidate, can_demote: bool) -> EvictAction:
        if candidate.replicas > 1 or not can_demote:
            return EvictAction.DROP
        return EvictAction.DEMOTE


POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    PrefixReplicaLRUPolicy.name: PrefixReplicaLRUPolicy,
}


@dataclass(frozen=True)
class TierBlock:
    """One block of the tier being evicted from, as the mechanism sees it.

    ``evictable`` is False for pinned blocks and blocks being read. ``blocking_children``
    counts this block's children that keep it from being a leaf (computed by the caller).
    """

    candidate: Candidate
    parent: BlockKey | None
    evictable: bool
    blocking_children: int


def select_victims(
    blocks: Mapping[BlockKey, TierBlock], need_bytes: int, policy: EvictionPolicy
) -> list[BlockKey]:
    """Victims, in eviction order, freeing at least ``need_bytes`` (or as much as possible).

    Pure. Pinned (non-evictable) blocks are never chosen. With ``policy.leaves_first``, a block
    becomes a candidate only after all its blocking children were chosen; if that leaves too
    little (a pinned child, or parent links forming a cycle), the remaining evictable blocks
    are considered without the constraint, in priority order.
    """
    if need_bytes <= 0:
        return []
    remaining = {key: block.blocking_children for key, block in blocks.items()}
    heap: list[tuple[tuple[int, ...], bytes]] = []
    for key, block in blocks.items():
        if block.evictable and (not policy.leaves_first or block.blocking_children == 0):
            heap.append((policy.priority(block.candidate), key))
    heapq.heapify(heap)
    chosen: list[BlockKey] = []
    chosen_set: set[bytes] = set()
    freed = 0
    while heap and freed < need_bytes:
        _, key = heapq.heappop(heap)
        block = blocks[BlockKey(key)]
        chosen.append(BlockKey(key))
        chosen_set.add(key)
        freed += block.candidate.nbytes
        parent = block.parent
        if policy.leaves_first and parent is not None and parent in remaining:
            remaining[parent] -= 1
            parent_block = blocks[parent]
            if remaining[parent] == 0 and parent_block.evictable:
                heapq.heappush(heap, (policy.priority(parent_block.candidate), parent))
    if freed < need_bytes and policy.leaves_first:
        rest = sorted(
            (policy.priority(b.candidate), k)
            for k, b in blocks.items()
            if b.evictable and k not in chosen_set
        )
        if rest:
            logger.warning(
                "eviction: %d bytes short with leaves first; evicting %d non-leaf candidates",
                need_bytes - freed,
                len(rest),
            )
        for _, key in rest:
            if freed >= need_bytes:
                break
            chosen.append(BlockKey(key))
            freed += blocks[BlockKey(key)].candidate.nbytes
    return chosen
