"""Heartbeat: keeps this process's shards alive in the metadata group (embedded server and
node alike).

Each beat tells the group that every member is alive; a member the group no longer knows (it
was reaped as dead, or the metadata group is new) is registered again with its address and
kind, and re-adopts what its shard holds (``replace_holdings``), so readers find its blocks
again. Blocking calls run in a worker thread; one failed beat is logged and the next one tries
again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvflow.kvdb import Shard
from kvflow.replication import NodeId

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """One shard's node as registered in the metadata: id, address peers use, kind."""

    node_id: str
    address: str
    kind: str
    shard: Shard


def local_clock() -> float | None:
    """The time an in-process metadata group is told (its replicas share this clock)."""
    return time.time()


def server_clock() -> float | None:
    """None: a remote metadata group stamps heartbeats with its own clock, so that nodes on
    machines whose clocks differ are judged alike."""
    return None


class Heartbeat:
    """``metadata``: a MetadataGroup (with ``clock=local_clock``) or RemoteMetadata
    (``server_clock``). Not thread-safe: one loop per process."""

    def __init__(
        self,
        metadata: Any,
        members: list[Member],
        interval_s: float = 1.0,
        clock: Callable[[], float | None] = local_clock,
    ) -> None:
        self._metadata = metadata
        self._members = members
        self._interval_s = interval_s
        self._clock = clock
        #: time.monotonic() of the last beat the group took for every member (or of the
        #: registration, ``mark_ok``); None before either. Readiness reads it.
        self.last_ok: float | None = None

    def mark_ok(self) -> None:
        """Every member is registered now (the caller registered them)."""
        self.last_ok = time.monotonic()

    def register_all(self) -> None:
        """Register every member (before its store re-adopts, and at start). Blocking."""
        for m in self._members:
            self._metadata.register_node(NodeId(m.node_id), m.address, m.kind, self._clock())
        self.mark_ok()

    def beat_once(self) -> None:
        """One heartbeat for every member; re-register and re-adopt the forgotten. Blocking."""
        ok = True
        for m in self._members:
            node = NodeId(m.node_id)
            try:
                if not self._metadata.heartbeat(node, self._clock()):
                    self._metadata.register_node(node, m.address, m.kind, self._clock())
                    self._metadata.replace_holdings(node, m.shard.holdings(), self._clock())
                    logger.info("node=%s re-registered and re-adopted its blocks", node)
            except Exception:
                ok = False
                logger.warning("node=%s heartbeat failed", node, exc_info=True)
        if ok:
            self.mark_ok()

    async def run(self) -> None:
        """Beat every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self._interval_s)
            await asyncio.to_thread(self.beat_once)
