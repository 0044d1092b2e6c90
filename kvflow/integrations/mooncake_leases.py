"""Leases and pins of Mooncake Store objects, as its master keeps them: a read (get,
get_into, get_buffer, get_size, is_exist, ...) grants the object a lease of the lease TTL,
and a remove without ``force`` of a leased object returns OBJECT_HAS_LEASE; a soft pin
records how long the object is protected from eviction; a hard pin, until it is removed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable


class Leases:
    """Per object name: lease and soft-pin deadlines (monotonic seconds), hard pins.
    Thread-safe."""

    def __init__(self, lease_ttl_ms: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_ttl_s = lease_ttl_ms / 1000.0
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, float] = {}
        self._soft: dict[str, float] = {}
        self._hard: set[str] = set()

    def grant(self, names: Iterable[str]) -> None:
        until = self._clock() + self.lease_ttl_s
        with self._lock:
            for name in names:
                self._leases[name] = until

    def leased(self, name: str) -> bool:
        with self._lock:
            until = self._leases.get(name)
            if until is None:
                return False
            if until > self._clock():
                return True
            del self._leases[name]
            return False

    def release(self, name: str) -> None:
        """The object's lease ends now (it was replaced by a new object)."""
        with self._lock:
            self._leases.pop(name, None)

    def pin(self, name: str, soft_ms: int | None, hard: bool) -> None:
        """After a write: the object's pins (None / False: none)."""
        with self._lock:
            self._soft.pop(name, None)
            self._hard.discard(name)
            if soft_ms is not None:
                self._soft[name] = self._clock() + soft_ms / 1000.0
            if hard:
                self._hard.add(name)

    def pinned(self, name: str) -> bool:
        """Soft-pinned (unexpired) or hard-pinned: eviction passes it over."""
        with self._lock:
            return name in self._hard or self._soft.get(name, 0.0) > self._clock()

    def forget(self, name: str) -> None:
        with self._lock:
            self._leases.pop(name, None)
            self._soft.pop(name, None)
            self._hard.discard(name)

    def clear(self) -> None:
        with self._lock:
            self._leases.clear()
            self._soft.clear()
            self._hard.clear()


__all__ = ["Leases"]
