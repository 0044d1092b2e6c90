"""What the conductor knows about one engine instance: its queue, its decode batch, its health.

The caller (the server, or the simulator) owns these objects and mutates them as work is routed,
started and finished; the conductor only reads them. Every method is thread-safe (one lock per
instance), and every reader returns a consistent snapshot.
"""

from __future__ import annotations

import enum
import math
import threading
import weakref
from dataclasses import dataclass
from typing import NamedTuple

from kvflow.router.errors import UnknownInstanceError


class InstanceKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class InstanceSnapshot(NamedTuple):
    """A consistent read of one instance at ``now`` (what a policy sees). A named tuple, not a
    frozen dataclass: the conductor takes one per instance per decision, and a tuple is built
    several times faster (it matters at 256 instances)."""

    instance_id: str
    kind: InstanceKind
    healthy: bool
    queued_requests: int
    queued_seconds: float
    decode_batch_size: int
    decode_context_tokens: int


class LoadTerms(NamedTuple):
    """The terms a snapshot is computed from, for readers that cache per-instance arrays
    (:class:`~kvflow.router.load_table.LoadTable`).

    ``queued_seconds(now) = (waiting_s + r_1 + r_2 + ...) + external_s`` summed in that order,
    where ``r_k = max(0.0, predicted_k - (now - started_k))`` for each ``running`` entry
    ``(predicted_k, started_k)`` in start order (``predicted_k`` when ``now`` is None).
    ``decode_batch_size`` and ``decode_context_tokens`` include the external load.
    """

    healthy: bool
    queued_requests: int
    waiting_s: float
    running: tuple[tuple[float, float], ...]
    external_s: float
    decode_batch_size: int
    decode_context_tokens: int


class ChangeSet(set["InstanceState"]):
    """A set that watched instances add themselves to when they change
    (:meth:`InstanceState.watch`); a plain set cannot be weakly referenced, this one can."""


@dataclass
class _Queued:
    predicted_s: float
    started_at: float | None = None


class InstanceState:
    """Mutable load of one instance.

    Prefill side: a FIFO of predicted prefill seconds keyed by request id (``enqueue`` /
    ``start`` / ``finish``); :meth:`queued_seconds` is the paper's EstimatePrefillQueueTime — the
    sum of what is queued plus what remains of what is running.

    Decode side: the requests in (or reserved for) the decode batch with their context tokens
    (``add_decode`` / ``grow_decode`` / ``remove_decode``).

    Reported load: with several routers, each books only its own requests. ``set_reported_load``
    takes what the instance itself reports (every router's work); the part this router has not
    booked is kept as external load and added to every snapshot until the next report.
    """

    def __init__(self, instance_id: str, kind: InstanceKind | str, healthy: bool = True) -> None:
        if not instance_id:
            raise ValueError("instance_id must be a non-empty string")
        self.instance_id = instance_id
        self.kind = InstanceKind(kind)
        self._healthy = healthy
        self._queue: dict[str, _Queued] = {}
        self._decode: dict[str, int] = {}
        # incremental sums, so a snapshot costs O(running requests), not O(queue + batch)
        self._waiting_s = 0.0  # predicted seconds of queued requests not started yet
        self._waiting = 0  # how many of those
        self._running: dict[str, _Queued] = {}
        self._decode_tokens = 0
        self._snap: InstanceSnapshot | None = None  # valid while nothing runs (no ``now``)
        self._external = (0.0, 0, 0)  # queued seconds, decode batch, decode context tokens
        self._lock = threading.Lock()
        self._watchers: list[weakref.ref[ChangeSet]] = []

    # --- change notification ----------------------------------------------------------------
    def watch(self, changed: ChangeSet) -> None:
        """Add this instance to ``changed`` on every mutation from now on. ``changed`` is held
        by weak reference (when it goes away the instance stops adding to it). The add happens
        under this instance's lock, possibly before the mutation's effect: the owner of the set
        reads the instance later (:meth:`load_terms`) and must not hold its own locks while
        the instance could be mutated under them."""
        with self._lock:
            self._watchers.append(weakref.ref(changed))

    def _changed(self) -> None:
        """Every mutation calls this first, under the lock."""
        self._snap = None  # the cached snapshot is stale
        if self._watchers:
            for ref in self._watchers:
                changed = ref()
                if changed is None:  # its owner is gone: forget the dead references
                    self._watchers = [r for r in self._watchers if r() is not None]
                    break
                changed.add(self)
            else:
                return
            self._changed()  # once more over the live ones

    # --- health -------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        with self._lock:
            return self._healthy

    def set_healthy(self, healthy: bool) -> None:
        with self._lock:
            self._changed()
            self._healthy = healthy

    # --- prefill queue ------------------------------------------------------------------------
    def enqueue(self, request_id: str, predicted_s: float) -> None:
        """Add a request's predicted prefill seconds. ValueError on a duplicate id or bad time."""
        if not (math.isfinite(predicted_s) and predicted_s >= 0):
            raise ValueError(f"predicted_s must be finite and >= 0, got {predicted_s}")
        with self._lock:
            self._changed()
            if request_id in self._queue:
                raise ValueError(f"request_id {request_id!r} already queued on {self.instance_id}")
            self._queue[request_id] = _Queued(predicted_s)
            self._waiting_s += predicted_s
            self._waiting += 1

    def start(self, request_id: str, now: float) -> None:
        """Mark a queued request as running since ``now``; UnknownInstanceError if not queued."""
        with self._lock:
            self._changed()
            entry = self._queue.get(request_id)
            if entry is None:
                raise UnknownInstanceError(
                    f"request {request_id!r} not queued on {self.instance_id}"
                )
            if entry.started_at is None:
                self._unwait(entry)
                self._running[request_id] = entry
            entry.started_at = now

    def finish(self, request_id: str) -> None:
        """Remove a request from the queue; UnknownInstanceError if it is not there."""
        with self._lock:
            self._changed()
            entry = self._queue.pop(request_id, None)
            if entry is None:
                raise UnknownInstanceError(
                    f"request {request_id!r} not queued on {self.instance_id}"
                )
            if entry.started_at is None:
                self._unwait(entry)
            else:
                del self._running[request_id]

    def _unwait(self, entry: _Queued) -> None:
        self._waiting -= 1
        # exact zero when nothing waits, whatever rounding the running sum collected
        self._waiting_s = max(0.0, self._waiting_s - entry.predicted_s) if self._waiting else 0.0

    def queued_seconds(self, now: float | None = None) -> float:
        """Predicted seconds of prefill work ahead of a new request.

        A started request counts only its remaining predicted time when ``now`` is given
        (never below 0); without ``now`` it counts in full.
        """
        with self._lock:
            return self._queued_seconds_locked(now)

    def _queued_seconds_locked(self, now: float | None) -> float:
        total = self._waiting_s
        for entry in self._running.values():
            assert entry.started_at is not None
            if now is not None:
                total += max(0.0, entry.predicted_s - (now - entry.started_at))
            else:
                total += entry.predicted_s
        return total

    @property
    def queued_requests(self) -> int:
        with self._lock:
            return len(self._queue)

    # --- decode batch -------------------------------------------------------------------------
    def add_decode(self, request_id: str, context_tokens: int) -> None:
        """Add (or reserve) a request in the decode batch. ValueError on duplicates / negatives."""
        if context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
        with self._lock:
            self._changed()
            if request_id in self._decode:
                raise ValueError(
                    f"request_id {request_id!r} already decoding on {self.instance_id}"
                )
            self._decode[request_id] = context_tokens
            self._decode_tokens += context_tokens

    def grow_decode(self, request_id: str, tokens: int = 1) -> None:
        """Account ``tokens`` more context for a decoding request (one per generated token)."""
        with self._lock:
            self._changed()
            if request_id not in self._decode:
                raise UnknownInstanceError(
                    f"request {request_id!r} not decoding on {self.instance_id}"
                )
            self._decode[request_id] += tokens
            self._decode_tokens += tokens

    def remove_decode(self, request_id: str) -> None:
        with self._lock:
            self._changed()
            tokens = self._decode.pop(request_id, None)
            if tokens is None:
                raise UnknownInstanceError(
                    f"request {request_id!r} not decoding on {self.instance_id}"
                )
            self._decode_tokens -= tokens

    @property
    def decode_batch_size(self) -> int:
        with self._lock:
            return len(self._decode)

    @property
    def decode_context_tokens(self) -> int:
        with self._lock:
            return self._decode_tokens

    # --- load reported by the instance ---------------------------------------------------------
    def set_reported_load(
        self,
        queued_seconds: float,
        decode_batch_size: int,
        decode_context_tokens: int,
        now: float | None = None,
    ) -> None:
        """The instance's own account of its load (all routers' requests). What exceeds this
        router's books at this moment is external load, added to snapshots. ValueError on
        negative or non-finite values."""
        if not (math.isfinite(queued_seconds) and queued_seconds >= 0):
            raise ValueError(f"queued_seconds must be finite and >= 0, got {queued_seconds}")
        if decode_batch_size < 0 or decode_context_tokens < 0:
            raise ValueError("decode_batch_size and decode_context_tokens must be >= 0")
        with self._lock:
            self._changed()
            self._external = (
                max(0.0, queued_seconds - self._queued_seconds_locked(now)),
                max(0, decode_batch_size - len(self._decode)),
                max(0, decode_context_tokens - self._decode_tokens),
            )

    @property
    def external_load(self) -> tuple[float, int, int]:
        """(queued seconds, decode batch, decode context tokens) booked by other routers."""
        with self._lock:
            return self._external

    def snapshot(self, now: float | None = None) -> InstanceSnapshot:
        """A consistent read of every field at once (external load included)."""
        with self._lock:
            if self._snap is not None and not self._running:
                return self._snap  # nothing changed since, and nothing depends on ``now``
            ext_s, ext_batch, ext_ctx = self._external
            snap = InstanceSnapshot(
                instance_id=self.instance_id,
                kind=self.kind,
                healthy=self._healthy,
                queued_requests=len(self._queue),
                queued_seconds=self._queued_seconds_locked(now) + ext_s,
                decode_batch_size=len(self._decode) + ext_batch,
                decode_context_tokens=self._decode_tokens + ext_ctx,
            )
            self._snap = snap
            return snap

    def load_terms(self) -> LoadTerms:
        """A consistent read of the terms of :meth:`snapshot` (see :class:`LoadTerms`)."""
        with self._lock:
            ext_s, ext_batch, ext_ctx = self._external
            running = (
                tuple([(e.predicted_s, e.started_at) for e in self._running.values()])
                if self._running
                else ()
            )
            return LoadTerms(
                self._healthy, len(self._queue), self._waiting_s, running, ext_s,
                len(self._decode) + ext_batch, self._decode_tokens + ext_ctx,
            )  # fmt: skip

    def __repr__(self) -> str:
        s = self.snapshot()
        return (
            f"InstanceState({s.instance_id!r}, {s.kind.value}, healthy={s.healthy}, "
            f"queued={s.queued_requests}/{s.queued_seconds:.3f}s, decode={s.decode_batch_size})"
        )


class UnlockedInstanceState(InstanceState):
    """An :class:`InstanceState` for a single-threaded owner (the simulator): the hot mutations
    and :meth:`load_terms` take no lock and notify watchers inline, with the same effects,
    checks and errors as the locked methods. Not thread-safe; servers use
    :class:`InstanceState`. Methods not overridden here still lock (harmless: one thread)."""

    def enqueue(self, request_id: str, predicted_s: float) -> None:
        if not (math.isfinite(predicted_s) and predicted_s >= 0):
            raise ValueError(f"predicted_s must be finite and >= 0, got {predicted_s}")
        self._notify()
        if request_id in self._queue:
            raise ValueError(f"request_id {request_id!r} already queued on {self.instance_id}")
        self._queue[request_id] = _Queued(predicted_s)
        self._waiting_s += predicted_s
        self._waiting += 1

    def start(self, request_id: str, now: float) -> None:
        self._notify()
        entry = self._queue.get(request_id)
        if entry is None:
            raise UnknownInstanceError(f"request {request_id!r} not queued on {self.instance_id}")
        if entry.started_at is None:
            self._unwait(entry)
            self._running[request_id] = entry
        entry.started_at = now

    def finish(self, request_id: str) -> None:
        self._notify()
        entry = self._queue.pop(request_id, None)
        if entry is None:
            raise UnknownInstanceError(f"request {request_id!r} not queued on {self.instance_id}")
        if entry.started_at is None:
            self._unwait(entry)
        else:
            del self._running[request_id]

    def add_decode(self, request_id: str, context_tokens: int) -> None:
        if context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
        self._notify()
        if request_id in self._decode:
            raise ValueError(f"request_id {request_id!r} already decoding on {self.instance_id}")
        self._decode[request_id] = context_tokens
        self._decode_tokens += context_tokens

    def remove_decode(self, request_id: str) -> None:
        self._notify()
        tokens = self._decode.pop(request_id, None)
        if tokens is None:
            raise UnknownInstanceError(f"request {request_id!r} not decoding on {self.instance_id}")
        self._decode_tokens -= tokens

    def _notify(self) -> None:
        """:meth:`InstanceState._changed` for the live watchers, without a call per watcher
        (a dead one sends it to the general path, which forgets it)."""
        self._snap = None
        for ref in self._watchers:
            changed = ref()
            if changed is None:
                self._changed()
                return
            changed.add(self)

    def load_terms(self) -> LoadTerms:
        ext_s, ext_batch, ext_ctx = self._external
        running = (
            tuple([(e.predicted_s, e.started_at) for e in self._running.values()])
            if self._running
            else ()
        )
        return LoadTerms(
            self._healthy, len(self._queue), self._waiting_s, running, ext_s,
            len(self._decode) + ext_batch, self._decode_tokens + ext_ctx,
        )  # fmt: skip
