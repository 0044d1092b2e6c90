"""Replica placement: where the next copies of a block go. Pure functions, no I/O.

Used by whoever acts on replica targets (``set_replica_target`` / kvdb ``change_replica``):
it reads the holders and the per-node load from the metadata and asks where to copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvflow.replication.types import NodeId, Tier


@dataclass(frozen=True)
class NodeLoad:
    """A candidate for a new replica: how many blocks it holds and whether it is healthy."""

    node: NodeId
    blocks: int
    healthy: bool = True


def choose_targets(
    holders: Mapping[NodeId, Tier], target: int, candidates: Sequence[NodeLoad]
) -> list[NodeId]:
    """The nodes that should receive a copy so the block has ``target`` replicas.

    Healthy candidates that do not hold the block yet, least loaded first (ties by node id, so
    the choice is deterministic); as many as are missing, fewer if there are not enough.
    Empty when the block already has ``target`` replicas or more. Raises ValueError for a
    target below 1.
    """
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise ValueError(f"target must be an int >= 1, got {target!r}")
    missing = target - len(holders)
    if missing <= 0:
        return []
    free = [c for c in candidates if c.healthy and c.node not in holders]
    free.sort(key=lambda c: (c.blocks, c.node))
    return [c.node for c in free[:missing]]


def choose_source(holders: Mapping[NodeId, Tier], available: Sequence[NodeId]) -> NodeId | None:
    """The holder to copy from: one that is available, a DRAM copy before an SSD one (ties by
    node id). None when no holder is available."""
    usable = [n for n in holders if n in available]
    if not usable:
        return None
    return min(usable, key=lambda n: (holders[n] is not Tier.DRAM, n))
