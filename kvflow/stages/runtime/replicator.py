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

Values of any size move (the remote read sizes its buffer from the holder's lease). A block
that cannot be copied — its source failed, the destination refused it (a shard of fixed
value size, a full device), or anything raised — is logged, counted in ``failed`` and in
``kvflow_replicator_failures_total{reason}``, and the pass goes on with the next block.
Copies made are ``kvflow_replicator_copies_total``. (Puts with N replicas do not wait for
this loop: ``kvdb.ReplicaWriter`` makes their copies before the put returns; this loop
restores a target after a copy is lost.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from kvflow.kvdb import KVDBError, Shard
from kvflow.pipeline import Metrics
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
        metrics: Metrics | None = None,
    ) -> None:
        self._view = view
        self._shards = shards
        self._remote = remote
        self._remote_nodes = remote_nodes or (lambda: [])
        self._target_kind = target_kind
        self._dead_after_s = dead_after_s
        self._batch = batch
        self.copied = 0
        self.failed = 0
        metrics = metrics or Metrics()
        self._copies = metrics.counter(
            "replicator_copies", "Block copies the replicator made toward replica targets"
        )
        self._failures = metrics.counter(
            "replicator_failures",
            "Block copies the replicator could not make (reason: read = no holder could be "
            "read, store = the destination refused it, error = anything else); retried on "
            "the next pass",
            ["reason"],
        )

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
            try:
                copied += self._copy(view, key, target, loads, local)
            except Exception as exc:  # isolate it: the other blocks still move
                self._failed(key, "error", exc)
        self.copied += copied
        if copied:
            self._copies.inc(copied)
            logger.info("replicator: %d block copies toward their replica targets", copied)
        return copied

    def _copy(
        self,
        view: MetadataView,
        key: bytes,
        target: int,
        loads: list[NodeLoad],
        local: list[NodeId],
    ) -> int:
        """The copies of ``key`` that fall to this process's shards; how many it made."""
        holders = view.replicas(key)
        mine = [d for d in choose_targets(holders, target, loads) if d in self._shards]
        if not mine:
            return 0
        block = self._read(key, holders, local)
        if block is None:
            if holders:  # nobody held it (evicted everywhere) is no failure
                self._failed(key, "read", None)
            return 0
        copied = 0
        for dest in mine:
            try:
                tier = self._shards[dest].put(key, block.value, block.parent, block.tenant)
            except KVDBError as exc:  # a fixed-size shard, a full device
                self._failed(key, "store", exc)
                continue
            if tier is None:
                self._failed(key, "store", None)
            copied += tier is not None
        return copied

    def _failed(self, key: bytes, reason: str, exc: BaseException | None) -> None:
        self.failed += 1
        self._failures.labels(reason).inc()
        logger.warning(
            "replicator: key=%s not copied (%s): %s",
            key.hex(),
            reason,
            exc if exc is not None else "no room / no readable holder",
            exc_info=reason == "error",
        )

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
