"""Replicator: acts on replica targets (kvdb ``change_replica``), the same loop in the embedded
server and on every prefill node.

Each pass reads the blocks below their target from the metadata. For each, the placement is
computed from the metadata alone (``replication.choose_targets`` over the healthy nodes of the
target kind, least loaded first), so every process that runs a replicator agrees on it; the
process copies the block into each chosen target that is one of *its* shards, from a holder in
this process if there is one (``choose_source``), else from another node through ``remote``.
A copy keeps the block's parent and owner tenant (the admin views filter on the owner). The
copies report themselves to the metadata through the shards' own event sync, so the next
pass sees the new counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from kvflow.kvdb import Shard
from kvflow.replication import MetadataView, NodeId, NodeLoad, choose_source, choose_targets

logger = logging.getLogger(__name__)


class BlockCopy(NamedTuple):
    """One block read for a copy: its bytes (a fresh buffer), parent key and owner tenant."""

    value: object
    parent: bytes | None
    tenant: str


# reads one block of another node: (source node, key) -> the copy, or None (a miss)
RemoteRead = Callable[[NodeId, bytes], BlockCopy | None]


class Replicator:
    """``shards``: this process's shards by node id (copy destinations, and local sources).
    ``remote``/``remote_nodes``: how to read a block another node holds, and which nodes can
    be read (None: copies come from local shards only). A candidate target is a node of
    ``target_kind`` whose last heartbeat is younger than ``dead_after_s``.

    ``run_once`` is blocking I/O: call it from a worker thread. Not re-entrant."""

    def __init__(
        self,
        view: Callable[[], MetadataView],
        shards: Mapping[str, Shard],
        remote: RemoteRead | None = None,
        remote_nodes: Callable[[], list[str]] | None = None,
        target_kind: str = "prefill",
        dead_after_s: float = 5.0,
        batch: int = 256,
    ) -> None:
        self._view = view
        self._shards = shards
        self._remote = remote
        self._remote_nodes = remote_nodes or (lambda: [])
        self._target_kind = target_kind
        self._dead_after_s = dead_after_s
        self._batch = batch
        self.copied = 0

    def candidates(self, view: MetadataView, now: float) -> list[NodeLoad]:
        """The nodes new replicas may go to, with their load and health."""
        return [
            NodeLoad(
                info.node,
                view.blocks_on(info.node),
                healthy=now - info.last_heartbeat < self._dead_after_s,
            )
            for info in view.nodes()
            if info.kind == self._target_kind
        ]

    def run_once(self, now: float | None = None) -> int:
        """One pass; returns how many copies this process made."""
        view = self._view()
        wanted = view.under_replicated(self._batch)
        if not wanted:
            return 0
        loads = self.candidates(view, time.time() if now is None else now)
        local = [NodeId(s) for s in self._shards]
        copied = 0
        for key, _count, target in wanted:
            holders = view.replicas(key)
            mine = [d for d in choose_targets(holders, target, loads) if d in self._shards]
            if not mine:
                continue
            block = self._read(key, holders, local)
            if block is None:
                continue
            for dest in mine:
                tier = self._shards[dest].put(key, block.value, block.parent, block.tenant)
                copied += tier is not None
        self.copied += copied
        if copied:
            logger.info("replicator: %d block copies toward their replica targets", copied)
        return copied

    def _read(
        self, key: bytes, holders: Mapping[NodeId, object], local: list[NodeId]
    ) -> BlockCopy | None:
        source = choose_source(holders, local)  # type: ignore[arg-type]
        if source is not None:  # None below: evicted since the metadata was read
            shard = self._shards[source]
            info = shard.info(key)
            value = None if info is None else shard.get(key)
            if value is None or info is None:
                return None
            return BlockCopy(value, info.parent, info.tenant)
        if self._remote is None:
            return None
        remote = choose_source(holders, [NodeId(n) for n in self._remote_nodes()])  # type: ignore[arg-type]
        return None if remote is None else self._remote(remote, key)

    async def run(self, interval_s: float = 1.0) -> None:
        """A pass every ``interval_s`` until cancelled; a failed pass is logged."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await asyncio.to_thread(self.run_once)
            except Exception:
                logger.warning("replicator pass failed", exc_info=True)
