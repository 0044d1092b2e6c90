"""SIEVE: the eviction policy of the endpoint pool (Zhang et al., NSDI '24; Mooncake §3.2.3).

Pure bookkeeping over keys, no I/O: the pool decides which key to evict and the caller closes
whatever the key stands for. Keys sit in a FIFO queue (oldest at the tail) with a "visited" bit set
on every hit. To evict, a hand walks from where it last stopped (first: the tail) towards the
head, clearing visited bits, and evicts the first key whose bit is clear; it wraps to the tail.
New keys enter at the head; a hit never moves a key.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class SieveQueue(Generic[K]):
    """SIEVE over at most ``capacity`` keys. Not thread-safe: callers hold their own lock."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._keys: list[K] = []  # index 0 is the tail (oldest), -1 the head (newest)
        self._visited: dict[K, bool] = {}
        self._hand: int | None = None  # index of the next key the hand looks at

    def __contains__(self, key: object) -> bool:
        return key in self._visited

    def __len__(self) -> int:
        return len(self._keys)

    def order(self) -> list[K]:
        """Keys from the tail (oldest) to the head (newest)."""
        return list(self._keys)

    def touch(self, key: K) -> None:
        """Mark a hit; KeyError if absent."""
        if key not in self._visited:
            raise KeyError(key)
        self._visited[key] = True

    def insert(self, key: K) -> K | None:
        """Add a new key at the head, evicting (and returning) one key first if full.

        ValueError if the key is already present.
        """
        if key in self._visited:
            raise ValueError(f"key {key!r} is already in the queue")
        evicted = self.evict() if len(self._keys) >= self.capacity else None
        self._keys.append(key)
        self._visited[key] = False
        return evicted

    def evict(self) -> K:
        """Remove and return the victim chosen by the hand; IndexError if empty."""
        if not self._keys:
            raise IndexError("evict from an empty SieveQueue")
        index = self._hand if self._hand is not None else 0
        while self._visited[self._keys[index]]:
            self._visited[self._keys[index]] = False
            index = index + 1 if index + 1 < len(self._keys) else 0
        victim = self._keys.pop(index)
        del self._visited[victim]
        # The hand stays on the key that followed the victim (now at ``index``).
        self._hand = index if index < len(self._keys) else None
        return victim

    def remove(self, key: K) -> None:
        """Drop ``key`` without an eviction decision (a failed connection); no-op if absent."""
        if key not in self._visited:
            return
        index = self._keys.index(key)
        self._keys.pop(index)
        del self._visited[key]
        if self._hand is not None:
            if index < self._hand:
                self._hand -= 1
            if self._hand >= len(self._keys):
                self._hand = None
