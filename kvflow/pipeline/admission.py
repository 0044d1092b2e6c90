"""Admission: the waiting queue in front of a pipeline.

A request asks for a place (``AdmissionQueue.wait``) before it is submitted. While fewer than
the running limit hold one, it gets one at once; otherwise it waits in a queue ordered by
priority (``Priority.INTERACTIVE`` before ``Priority.WARMUP``), first come first served within
a priority. Only a full queue refuses a request (``QueueFull``, naming the limit), and a
request that waited ``queue_timeout_s`` in all is refused the same way. A waiting request
whose caller goes away (its task is cancelled) gives its place back at once.

The running limit adapts to what the engines can hold. A request that found no room once
admitted (no staging or KV pages: the caller says so with ``no_room``) gives its place back,
the limit drops to what still runs, and the request waits again at the head of its priority
(it keeps its first arrival's place) until a running request ends; each request that ends
well raises the limit by 1/limit (by one for every limit's worth of them, as TCP's
congestion window), up to ``max_running``. When nothing runs and there is still no
room, the head is retried after a short backoff.

``close()`` starts a graceful stop (a drain): from then on ``wait`` refuses every new request
with ``PipelineClosed`` (HTTP 503, gRPC UNAVAILABLE: clients go to another replica) while the
requests already queued or running go on; ``idle()`` tells when none is left.

::

    wait() ──► [running < limit?] ── yes ──► Ticket (the request runs) ──► release(ok)
                    │ no                                   │ no room
                    ▼                                      ▼
              the queue (priority, arrival) ◄──────── no_room(): limit = running

Use from one event loop.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.pipeline.errors import PipelineClosed, PipelineError
from kvflow.pipeline.metrics import Metrics

logger = logging.getLogger(__name__)

QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
MAX_BACKOFF_S = 1.0


class Priority(enum.IntEnum):
    """Lower is served first."""

    INTERACTIVE = 0
    WARMUP = 1


@dataclass(frozen=True)
class AdmissionConfig:
    """The queue's bounds.

    Attributes:
        max_queued_requests: requests that may wait at once (>= 1); the next is refused.
        max_queued_tokens: the tokens (prompt + max_tokens) of the waiting requests together
            (>= 1); a request that would pass it is refused (one alone may, so none is
            refused for its size while nothing waits).
        max_running: the most requests admitted at once (>= 1); the running limit starts
            here and never passes it.
        queue_timeout_s: the longest a request waits in all (> 0); then it is refused.
        backoff_s: how long the head waits when nothing runs and there was no room (> 0).
    """

    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 22
    max_running: int = 64
    queue_timeout_s: float = 300.0
    backoff_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_queued_tokens", "max_running"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("queue_timeout_s", "backoff_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


class QueueFull(PipelineError):
    """The waiting queue refused a request.

    Attributes:
        limit: the config field that refused it (``max_queued_requests``,
            ``max_queued_tokens`` or ``queue_timeout_s``).
        retry_after_s: when a retry could plausibly be admitted (>= 1).
    """

    def __init__(self, message: str, limit: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Ticket:
    """One request's place: taken by ``wait``, given back by ``release`` or ``no_room``."""

    seq: int
    tokens: int
    priority: Priority
    arrived: float
    admitted_at: float | None = None
    retries: int = 0
    held: bool = False

    @property
    def queued_s(self) -> float:
        """Seconds from arrival to the last admission (0 while never admitted)."""
        return 0.0 if self.admitted_at is None else self.admitted_at - self.arrived


@dataclass(order=True)
class _Entry:
    priority: int
    seq: int
    ticket: Ticket = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    gone: bool = field(default=False, compare=False)


class AdmissionQueue:
    """The queue and the running limit (see the module docstring). ``metrics``: when given,
    the queue's series are recorded on it (``admission_*``)."""

    def __init__(
        self,
        config: AdmissionConfig | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config if config is not None else AdmissionConfig()
        self._clock = clock
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._waiting = 0
        self._waiting_tokens = 0
        self._running = 0
        self._limit_f = float(self.config.max_running)
        self._paused_until = 0.0
        self._wake: asyncio.TimerHandle | None = None
        self._streak = 0  # consecutive no-room answers while nothing ran
        self._service_s = 1.0  # a moving average of how long an admitted request runs
        self._queue_seconds = self._refused = self._no_room = None
        self._closed: str | None = None
        if metrics is not None:
            self._metrics(metrics)

    def _metrics(self, m: Metrics) -> None:
        self._queue_seconds = m.histogram(
            "admission_queue_seconds",
            "Time a request waited in the admission queue before it ran",
            buckets=QUEUE_BUCKETS_S,
        )
        self._refused = m.counter(
            "admission_refused", "Requests the admission queue refused, by limit", ["limit"]
        )
        self._no_room = m.counter(
            "admission_no_room", "Admitted requests that found no room and waited again"
        )
        for name, doc, read in (
            ("admission_waiting_requests", "Requests waiting for admission", self.waiting),
            ("admission_waiting_tokens", "Tokens of the requests waiting", self.waiting_tokens),
            ("admission_running", "Requests admitted and running", self.running),
            ("admission_running_limit", "The running limit now", self.limit),
        ):
            m.gauge(name, doc).set_function(read)

    # -- introspection ------------------------------------------------------------------------
    def waiting(self, priority: Priority | None = None) -> int:
        """Requests waiting (of ``priority`` only, when given)."""
        if priority is None:
            return self._waiting
        return sum(1 for e in self._heap if not e.gone and e.priority == priority)

    def waiting_tokens(self) -> int:
        return self._waiting_tokens

    def running(self) -> int:
        return self._running

    def limit(self) -> int:
        return int(self._limit_f)

    @property
    def _limit(self) -> int:
        return int(self._limit_f)

    # -- the queue ----------------------------------------------------------------------------
    def close(self, reason: str = "draining") -> None:
        """Refuse new requests from now on (``PipelineClosed`` naming ``reason``); the queued
        and running ones go on. Idempotent."""
        if self._closed is None:
            self._closed = reason
            logger.info(
                "admission: closed (%s); %d running, %d waiting",
                reason,
                self._running,
                self._waiting,
            )

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def idle(self) -> bool:
        """No request runs and none waits."""
        return self._running == 0 and self._waiting == 0

    def ticket(self, tokens: int, priority: Priority = Priority.INTERACTIVE) -> Ticket:
        """A new request's ticket (not yet waiting: pass it to ``wait``)."""
        return Ticket(next(self._seq), max(0, int(tokens)), priority, self._clock())

    async def wait(self, ticket: Ticket) -> Ticket:
        """Wait for a place; returns ``ticket``, now held. A ticket that found no room
        (``no_room``) waits again with its first arrival's place. Raises QueueFull (the queue
        is full, or the ticket waited ``queue_timeout_s`` in all); a cancelled caller leaves
        the queue at once."""
        if ticket.held:
            raise ValueError("the ticket is already held")
        if self._closed is not None and ticket.retries == 0:
            raise PipelineClosed(f"not admitting new requests: {self._closed}")
        if not self._heap and self._running < self._limit and self._clock() >= self._paused_until:
            self._take(ticket)
            return ticket
        if ticket.retries == 0:
            self._check_room(ticket)
        entry = _Entry(
            int(ticket.priority), ticket.seq, ticket, asyncio.get_running_loop().create_future()
        )
        heapq.heappush(self._heap, entry)
        self._waiting += 1
        self._waiting_tokens += ticket.tokens
        self._pump()
        remaining = ticket.arrived + self.config.queue_timeout_s - self._clock()
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                await asyncio.shield(entry.future)
        except BaseException as exc:
            if ticket.held:  # admitted as the wait ended: give the place back
                self.release(ticket, ok=False)
            else:
                self._drop(entry)
            if isinstance(exc, TimeoutError):
                raise self._refuse(
                    "queue_timeout_s",
                    f"waited {self.config.queue_timeout_s:g} s in the admission queue without "
                    f"a place (queue_timeout_s {self.config.queue_timeout_s:g})",
                ) from None
            raise
        return ticket

    def release(self, ticket: Ticket, ok: bool = True) -> None:
        """The ticket's request ended (``ok``: it ran to its end; the limit rises by one)."""
        if not ticket.held:
            return
        ticket.held = False
        self._running -= 1
        if ok:
            self._streak = 0
            self._limit_f = min(float(self.config.max_running), self._limit_f + 1 / self._limit_f)
            if ticket.admitted_at is not None:
                ran = self._clock() - ticket.admitted_at
                self._service_s = 0.8 * self._service_s + 0.2 * ran
        self._pump()

    def no_room(self, ticket: Ticket) -> None:
        """The ticket's request was admitted but found no room (no pages): it gives its place
        back and the limit drops to what still runs; ``wait(ticket)`` again to retry."""
        if not ticket.held:
            return
        ticket.held = False
        ticket.retries += 1
        self._running -= 1
        self._limit_f = float(max(1, self._running))
        if self._no_room is not None:
            self._no_room.inc()
        if self._running == 0:  # nothing will end to make room: retry after a backoff
            self._streak += 1
            backoff = min(MAX_BACKOFF_S, self.config.backoff_s * 2 ** (self._streak - 1))
            self._paused_until = self._clock() + backoff
        logger.debug("admission: no room; limit %d, %d waiting", self._limit, self._waiting)

    # -- internals ----------------------------------------------------------------------------
    def _check_room(self, ticket: Ticket) -> None:
        c = self.config
        if self._waiting >= c.max_queued_requests:
            raise self._refuse(
                "max_queued_requests",
                f"the admission queue is full: {self._waiting} requests waiting "
                f"(max_queued_requests {c.max_queued_requests})",
            )
        if self._waiting and self._waiting_tokens + ticket.tokens > c.max_queued_tokens:
            raise self._refuse(
                "max_queued_tokens",
                f"the admission queue is full: {self._waiting_tokens} tokens waiting, "
                f"{ticket.tokens} more asked (max_queued_tokens {c.max_queued_tokens})",
            )

    def _refuse(self, limit: str, message: str) -> QueueFull:
        if self._refused is not None:
            self._refused.labels(limit=limit).inc()
        ahead = self._waiting + 1
        retry = self._service_s * ahead / max(1, self._limit)
        logger.info("admission refused (%s): %s", limit, message)
        return QueueFull(message, limit, float(min(60, max(1, math.ceil(retry)))))

    def _take(self, ticket: Ticket) -> None:
        ticket.held = True
        ticket.admitted_at = self._clock()
        self._running += 1
        if self._queue_seconds is not None:
            self._queue_seconds.observe(ticket.queued_s)

    def _drop(self, entry: _Entry) -> None:
        if not entry.gone:
            entry.gone = True
            self._waiting -= 1
            self._waiting_tokens -= entry.ticket.tokens
            self._pump()  # the next may fit where this one did not

    def _pump(self) -> None:
        now = self._clock()
        if now < self._paused_until:
            if self._wake is None and self._heap:
                loop = asyncio.get_running_loop()
                self._wake = loop.call_later(self._paused_until - now, self._woken)
            return
        while self._heap and self._running < self._limit:
            entry = heapq.heappop(self._heap)
            if entry.gone:
                continue
            entry.gone = True
            self._waiting -= 1
            self._waiting_tokens -= entry.ticket.tokens
            self._take(entry.ticket)
            entry.future.set_result(None)

    def _woken(self) -> None:
        self._wake = None
        self._pump()
