"""CircuitBreaker: stop calling a peer that keeps failing or timing out, probe it now and then.

Defined here because replication is the lowest layer that needs one (the metadata client's
failover between replicas); the router's node calls use the same class (``kvflow.replication``
exports it).

States: CLOSED (calls go through; ``failure_threshold`` consecutive failures open it), OPEN
(``allow()`` is False for ``open_s``), HALF_OPEN (after ``open_s``: ``allow()`` admits one
probe; its success closes the breaker, its failure opens it again for twice as long, up to
``max_open_s``). A timeout is a failure like any other: a hung peer opens the breaker as
surely as a dead one.

Deterministic: the clock is injected. Thread-safe (one lock); cheap enough to call on every
request.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    """failure_threshold: consecutive failures that open the breaker (>= 1). open_s: how long
    it stays open before the first half-open probe (> 0). max_open_s: cap of the doubling
    after failed probes (>= open_s)."""

    failure_threshold: int = 2
    open_s: float = 1.0
    max_open_s: float = 8.0

    def __post_init__(self) -> None:
        if isinstance(self.failure_threshold, bool) or self.failure_threshold < 1:
            raise ValueError(
                f"failure_threshold: must be an integer >= 1, got {self.failure_threshold!r}"
            )
        if not (math.isfinite(self.open_s) and self.open_s > 0):
            raise ValueError(f"open_s: must be a positive number of seconds, got {self.open_s!r}")
        if not (math.isfinite(self.max_open_s) and self.max_open_s >= self.open_s):
            raise ValueError(f"max_open_s: must be >= open_s, got {self.max_open_s!r}")


class CircuitBreaker:
    """One peer's breaker (module doc). ``opened`` counts the times it opened."""

    def __init__(
        self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._open_for = self.config.open_s
        self._open_until = 0.0
        self._probing = False
        self.opened = 0

    @property
    def state(self) -> BreakerState:
        """The state now (an OPEN breaker whose time is up reads HALF_OPEN)."""
        with self._lock:
            self._tick()
            return self._state

    def allow(self) -> bool:
        """May a call go to the peer now? In HALF_OPEN, True once (the probe) until its
        outcome is recorded: a caller that got True must report ``success`` or ``failure``.
        Mutates (it admits the probe); ``state`` only reads."""
        with self._lock:
            self._tick()
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def success(self) -> None:
        """A call (or probe) answered: the breaker closes."""
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._open_for = self.config.open_s
            self._probing = False

    def failure(self) -> bool:
        """A call failed or timed out. Returns True if this opened the breaker."""
        with self._lock:
            self._tick()
            if self._state is BreakerState.HALF_OPEN:
                self._open_for = min(self._open_for * 2, self.config.max_open_s)
                self._open(self._clock())
                return True
            if self._state is BreakerState.OPEN:
                return False
            self._failures += 1
            if self._failures >= self.config.failure_threshold:
                self._open(self._clock())
                return True
            return False

    def trip(self) -> bool:
        """Open now, whatever the count (the peer is known to be down). True if it was not
        open already."""
        with self._lock:
            self._tick()
            if self._state is BreakerState.OPEN:
                return False
            self._open(self._clock())
            return True

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._open_until = now + self._open_for
        self._probing = False
        self._failures = 0
        self.opened += 1

    def _tick(self) -> None:
        if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
            self._state = BreakerState.HALF_OPEN
            self._probing = False
