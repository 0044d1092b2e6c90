"""Replica counts for eviction come from outside the shard, through this provider interface.

On one node every block has exactly one copy (``LocalReplicas``); the cluster plugs in
``MetadataReplicas`` over the metadata group's read-only view.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from kvflow.replication import MetadataView, NodeId


class ReplicaCounter(abc.ABC):
    """How many nodes hold each block (this one included). Must be thread-safe and fast:
    called once per eviction round with every candidate."""

    @abc.abstractmethod
    def replica_counts(self, keys: Sequence[bytes]) -> list[int]:
        """One count (>= 1 for a block this shard holds) per key, in order."""


class LocalReplicas(ReplicaCounter):
    """One node: every block is a last copy."""

    def replica_counts(self, keys: Sequence[bytes]) -> list[int]:
        return [1] * len(keys)


class MetadataReplicas(ReplicaCounter):
    """Counts read from the metadata group's view: the nodes recorded as holders, plus this
    ``node`` if the metadata has not recorded it yet (it holds the block: it is asking)."""

    def __init__(self, view: MetadataView, node: NodeId) -> None:
        self._view = view
        self._node = node

    def replica_counts(self, keys: Sequence[bytes]) -> list[int]:
        counts = []
        for holders in self._view.holders(keys):
            counts.append(len(holders) + (0 if self._node in holders else 1))
        return counts
