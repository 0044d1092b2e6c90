"""Replica counts for eviction come from outside the shard, through this provider interface.

On one node every block has exactly one copy (``LocalReplicas``); the cluster plugs in
``MetadataReplicas`` over the metadata group's read-only view.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from kvflow.replication import MetadataView


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
    """Counts read from the metadata group's view (at least 1: this shard holds the block even
    if the metadata has not caught up yet)."""

    def __init__(self, view: MetadataView) -> None:
        self._view = view

    def replica_counts(self, keys: Sequence[bytes]) -> list[int]:
        return [max(1, self._view.replica_count(key)) for key in keys]
