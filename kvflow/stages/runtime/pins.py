"""PinBook: pins with a time to live on one shard (a node's, for warm-up jobs).

A router asks a node to pin blocks for ``ttl_s`` (``Node.Pin``); the node keeps the pins and
drops them itself when the TTL lapses, so they outlive the router that asked (a job's router
may die; its pins still end on time). Pinning a key that this book already pins extends its
expiry instead of stacking a second pin. Thread-safe; the clock is passed in.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


class PinBook:
    """``shard`` has ``pin(keys) -> list[bool]`` and ``unpin(keys)`` (kvdb.Shard)."""

    def __init__(self, shard: Any) -> None:
        self._shard = shard
        self._expiry: dict[bytes, float] = {}  # key -> when its pin lapses
        self._lock = threading.Lock()

    def pin(self, keys: Sequence[bytes], ttl_s: float, now: float) -> int:
        """Pin the held ``keys`` until ``now + ttl_s`` (a longer expiry wins for a key pinned
        already). Returns how many of ``keys`` are held (pinned now or before). ValueError for
        a TTL that is not positive."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        until = now + ttl_s
        with self._lock:
            fresh = list(dict.fromkeys(k for k in keys if k not in self._expiry))
            held = dict(zip(fresh, self._shard.pin(fresh), strict=True)) if fresh else {}
            n = 0
            for key in keys:
                if key in self._expiry:
                    self._expiry[key] = max(self._expiry[key], until)
                    n += 1
                elif held.get(key):
                    self._expiry[key] = until
                    n += 1
            return n

    def reap(self, now: float) -> int:
        """Unpin every key whose TTL lapsed by ``now``; returns how many."""
        with self._lock:
            due = [k for k, t in self._expiry.items() if t <= now]
            for key in due:
                del self._expiry[key]
            self._unpin(due)
            return len(due)

    def release_all(self) -> None:
        with self._lock:
            keys = list(self._expiry)
            self._expiry.clear()
            self._unpin(keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)

    def _unpin(self, keys: list[bytes]) -> None:
        for key in keys:  # one by one: a block removed meanwhile must not keep others pinned
            try:
                self._shard.unpin([key])
            except Exception:
                logger.warning("pin book: unpin key=%s failed", key.hex(), exc_info=True)
