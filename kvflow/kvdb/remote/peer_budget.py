"""PeerCallBudget and PeerBreakers: how long one node waits for another, and whether it calls
it at all.

Why: a dead peer fails a call at once (the connection is refused or reset); a *paused* one
(SIGSTOP, a stuck host) keeps its connections open and answers nothing, so a call waits for
its whole deadline. Node-to-node calls (a Lease / Release RPC and the block read of
``RemoteClient``, the KV stream of a prefill node into a decode node's staging) therefore get
a deadline sized to the bytes they move (``PeerCallBudget.deadline_s``), and each peer has
one ``CircuitBreaker`` shared by every call of the process (``PeerBreakers``): a call that
timed out opens it at once (a hung peer), other failures count towards its
``failure_threshold``; while it is open calls to the peer fail at once (the caller reads the
next replica or recomputes), after ``open_s`` one call goes through as the half-open probe.
A paused peer then costs one deadline (``base_s`` plus its bytes), once per ``open_s``.

A timeout is not an answer, though: a holder on a loaded host may take longer than ``base_s``
and still hold the data. A caller for which a miss is an answer (a store's ``get``: b"" tells
its client the object is gone) tries the holders that timed out once more, with the longer
``last_resort_s`` and whatever their breakers say (``kvflow.integrations.member.Misses``), when
no replica answered; a holder whose last-resort try timed out too is not given another one for
a while, so a peer paused for good costs one ``last_resort_s``, not one per read.

The router's node calls have their own budget (``stages/api/node_guard.NodeCallBudget``);
the breaker is ``kvflow.replication.CircuitBreaker``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, fields

from kvflow.replication import BreakerConfig, CircuitBreaker


@dataclass(frozen=True)
class PeerCallBudget:
    """Deadlines of one node's calls to another, and the per-peer breaker.

    base_s: every call's fixed part (a round trip plus scheduling slack on a loaded host).
    bytes_per_s: the slowest rate worth waiting for: a call that moves N bytes (a read, a
        stream batch; a Lease, which may promote N bytes from the holder's SSD) gets
        N / bytes_per_s more.
    ceiling_s: no deadline is longer (>= base_s).
    last_resort_s: the deadline of the one more try a caller that must not report a false
        miss gives holders that timed out when no replica answered (a byte-sized deadline
        still applies when longer; ceiling_s caps it).
    breaker: each peer's circuit breaker (a timeout opens it at once; ``failure_threshold``
        other failures in a row do).
    """

    base_s: float = 0.5
    bytes_per_s: float = float(64 << 20)
    ceiling_s: float = 30.0
    last_resort_s: float = 5.0
    breaker: BreakerConfig = field(
        default_factory=lambda: BreakerConfig(failure_threshold=2, open_s=1.0, max_open_s=8.0)
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "breaker" and not (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value > 0
            ):
                raise ValueError(f"{f.name}: must be a positive number, got {value!r}")
        if self.ceiling_s < self.base_s:
            raise ValueError(f"ceiling_s: must be >= base_s ({self.base_s}), got {self.ceiling_s}")
        if not isinstance(self.breaker, BreakerConfig):
            raise ValueError(f"breaker: must be a BreakerConfig, got {self.breaker!r}")

    def deadline_s(self, nbytes: int) -> float:
        """Seconds a call moving ``nbytes`` may take: base_s + nbytes / bytes_per_s, at most
        ceiling_s. ValueError for negative bytes."""
        if nbytes < 0:
            raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
        return min(self.ceiling_s, self.base_s + nbytes / self.bytes_per_s)

    def patient_deadline_s(self, nbytes: int, patience_s: float) -> float:
        """``deadline_s(nbytes)``, or ``patience_s`` (a last-resort try's, 0 = none) when
        longer; at most ceiling_s. ValueError for negative bytes or patience."""
        if not (math.isfinite(patience_s) and patience_s >= 0):
            raise ValueError(f"patience_s: must be >= 0, got {patience_s!r}")
        return min(self.ceiling_s, max(self.deadline_s(nbytes), patience_s))


class PeerBreakers:
    """One CircuitBreaker per peer (any hashable name: a node id, a transfer address),
    created on first use from ``budget.breaker``. Share one instance across a process's
    readers and streams so they all see a peer's state. Thread-safe."""

    def __init__(self, budget: PeerCallBudget | None = None) -> None:
        self.budget = budget or PeerCallBudget()
        self._lock = threading.Lock()
        self._breakers: dict[str, CircuitBreaker] = {}

    def get(self, peer: str) -> CircuitBreaker:
        """The peer's breaker (the same object on every call)."""
        with self._lock:
            breaker = self._breakers.get(peer)
            if breaker is None:
                breaker = self._breakers[peer] = CircuitBreaker(self.budget.breaker)
            return breaker

    def opened(self) -> dict[str, int]:
        """Times each peer's breaker opened (stats; a copy)."""
        with self._lock:
            return {peer: b.opened for peer, b in self._breakers.items()}
