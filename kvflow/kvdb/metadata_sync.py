"""MetadataSync: drains a shard's events into the metadata group, one Raft entry per flush.

The shard never calls the metadata per block: it appends events to an outbox this object owns;
``flush()`` collapses them (the last event per key wins) into ONE ``record_batch`` call. A
background thread flushes every ``interval_s``; ``close()`` flushes a last time. A failed
flush keeps its events and retries them with the next one (every metadata command is
idempotent). Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvflow.kvdb.events import BlockRemoved, BlockStored, Outbox
from kvflow.kvdb.shard import Shard
from kvflow.replication import MetadataGroup, NodeId, ReplicationError, Tier

logger = logging.getLogger(__name__)


class MetadataSync:
    """Keeps ``group``'s record of ``node``'s blocks in step with ``shard``."""

    def __init__(
        self,
        shard: Shard,
        group: MetadataGroup,
        node: NodeId,
        interval_s: float = 0.05,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._shard = shard
        self._group = group
        self._node = node
        self._interval = interval_s
        self._clock = clock
        self._outbox = Outbox(None)
        self._pending: dict[bytes, Tier | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.flushes = 0
        shard.add_outbox(self._outbox)

    def readopt(self) -> int:
        """Replace what the metadata records for this node with what the shard holds (after a
        restart). Returns the number of blocks recorded."""
        with self._lock:
            self._outbox.take()
            self._pending.clear()
            holdings = self._shard.holdings()
            self._group.replace_holdings(self._node, holdings, self._clock())
        logger.info("metadata: node=%s re-adopted %d blocks", self._node, len(holdings))
        return len(holdings)

    def flush(self) -> int:
        """Write pending events as one record_batch; returns the keys written (0: nothing to
        do). Raises the group's ReplicationError; the events are kept for the next flush."""
        with self._lock:
            for event in self._outbox.take():
                if isinstance(event, BlockStored):
                    self._pending[event.key] = event.tier
                elif isinstance(event, BlockRemoved):
                    self._pending[event.key] = None
            if not self._pending:
                return 0
            stored = [(k, t) for k, t in self._pending.items() if t is not None]
            removed = [k for k, t in self._pending.items() if t is None]
            self._group.record_batch(self._node, stored, removed, self._clock())
            n = len(self._pending)
            self._pending.clear()
            self.flushes += 1
            return n

    def start(self) -> None:
        """Start the background flusher (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"kvdb-metadata-sync-{self._node}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.flush()
            except ReplicationError as exc:
                logger.warning("metadata flush failed node=%s (will retry): %s", self._node, exc)

    def close(self) -> None:
        """Stop the flusher and flush what is left (errors logged, not raised). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.flush()
        except ReplicationError as exc:
            logger.warning("final metadata flush failed node=%s: %s", self._node, exc)
