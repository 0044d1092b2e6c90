"""LeaseTable: the outstanding DRAM leases of a block server, with expiry (pure bookkeeping).

A lease records which shard's blocks a remote reader was handed and when it lapses. The table
does not touch shards: the block server pins on grant and unpins what ``release`` / ``expire``
hand back. The current time is passed in, so tests drive expiry by hand.

Thread-safety: every method takes the table's lock.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass

from kvflow.kvdb.keys import BlockKey


@dataclass(frozen=True)
class Lease:
    """An outstanding lease: ``keys`` of shard ``shard`` hold one pin each until released or
    until ``expires_at`` (seconds on the table's clock)."""

    lease_id: int
    shard: str
    keys: tuple[BlockKey, ...]
    expires_at: float


class LeaseTable:
    """Lease ids start at 1 and are never reused within one table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped
        self._next_id = 1
        self.granted = 0
        self.released = 0
        self.expired = 0

    def grant(self, shard: str, keys: tuple[BlockKey, ...], now: float, timeout_s: float) -> Lease:
        """Record a new lease over ``keys`` (already pinned by the caller)."""
        with self._lock:
            lease = Lease(self._next_id, shard, keys, now + timeout_s)
            self._next_id += 1
            self._leases[lease.lease_id] = lease
            heapq.heappush(self._deadlines, (lease.expires_at, lease.lease_id))
            self.granted += 1
            return lease

    def release(self, lease_id: int) -> Lease | None:
        """Remove and return the lease (the caller unpins its keys); None if unknown or expired."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self.released += 1
            return lease

    def expire(self, now: float) -> list[Lease]:
        """Remove and return every lease whose deadline is <= ``now`` (the caller unpins)."""
        out: list[Lease] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, lease_id = heapq.heappop(self._deadlines)
                lease = self._leases.pop(lease_id, None)
                if lease is not None:
                    out.append(lease)
            self.expired += len(out)
        return out

    def drain(self) -> list[Lease]:
        """Remove and return every outstanding lease (shutdown)."""
        with self._lock:
            out = list(self._leases.values())
            self._leases.clear()
            self._deadlines.clear()
            return out

    def next_deadline(self) -> float | None:
        with self._lock:
            while self._deadlines and self._deadlines[0][1] not in self._leases:
                heapq.heappop(self._deadlines)
            return self._deadlines[0][0] if self._deadlines else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
