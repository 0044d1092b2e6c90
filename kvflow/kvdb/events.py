"""Block events and the outbox they are appended to.

The shard never calls upward (metadata, routers): it appends events to one or more outboxes,
and whoever owns an outbox drains it with ``take()``.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from kvflow.kvdb.keys import BlockKey
from kvflow.replication import Tier


@dataclass(frozen=True)
class BlockStored:
    """``key`` is now held by this shard with ``tier`` as its fastest tier (a new block, a
    demotion DRAM -> SSD, or a promotion SSD -> DRAM)."""

    key: BlockKey
    tier: Tier
    nbytes: int
    parent: BlockKey | None


@dataclass(frozen=True)
class BlockRemoved:
    """``key`` is no longer held by this shard in any tier."""

    key: BlockKey


BlockEvent = BlockStored | BlockRemoved


class Outbox:
    """A thread-safe FIFO of events. With ``capacity`` set, the oldest events are dropped
    (and counted in ``dropped``) when it overflows; with None it is unbounded."""

    def __init__(self, capacity: int | None) -> None:
        self._events: deque[BlockEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.dropped = 0

    def append(self, event: BlockEvent) -> None:
        with self._lock:
            if self._events.maxlen is not None and len(self._events) == self._events.maxlen:
                self.dropped += 1
            self._events.append(event)

    def take(self) -> list[BlockEvent]:
        """All pending events, oldest first; the outbox is left empty."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
