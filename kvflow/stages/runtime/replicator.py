"""Replicator: acts on replica targets (kvdb ``change_replica``) inside one process.

Each pass reads the blocks below their target from the metadata, picks a source holder and
target shards with ``replication.choose_source`` / ``choose_targets`` (least-loaded healthy
shards first) and copies the block's bytes shard to shard. The copies report themselves to the
metadata through the shards' own event sync, so the next pass sees the new counts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from kvflow.kvdb import Shard
from kvflow.replication import (
    MetadataView,
    NodeId,
    NodeLoad,
    choose_source,
    choose_targets,
)

logger = logging.getLogger(__name__)


class Replicator:
    """Brings blocks up to their replica target by copying them between local shards.

    ``shards`` maps node id -> shard (copies come from any of them); new replicas go to the
    ``targets`` (default: every shard; the embedded cluster uses its prefill shards).
    ``run_once`` is blocking I/O: call it from a worker thread. Not re-entrant.
    """

    def __init__(
        self,
        shards: Mapping[str, Shard],
        metadata: MetadataView,
        targets: Sequence[str] | None = None,
        batch: int = 256,
    ) -> None:
        self._shards = shards
        self._targets = [NodeId(t) for t in (targets if targets is not None else shards)]
        self._metadata = metadata
        self._batch = batch
        self.copied = 0

    def run_once(self) -> int:
        """One pass; returns how many copies it made."""
        view = self._metadata
        wanted = view.under_replicated(self._batch)
        if not wanted:
            return 0
        local = [NodeId(s) for s in self._shards]
        loads = [NodeLoad(n, view.blocks_on(n)) for n in self._targets]
        copied = 0
        for key, _count, target in wanted:
            holders = view.replicas(key)
            source = choose_source(holders, local)
            if source is None:
                continue  # held only outside this process
            for dest in choose_targets(holders, target, loads):
                if self._copy(key, self._shards[source], self._shards[dest]):
                    copied += 1
        self.copied += copied
        if copied:
            logger.info("replicator: %d block copies toward their replica targets", copied)
        return copied

    @staticmethod
    def _copy(key: bytes, source: Shard, dest: Shard) -> bool:
        value = source.get(key)
        if value is None:  # evicted since the metadata was read
            return False
        return dest.put(key, value) is not None
