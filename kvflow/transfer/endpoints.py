"""Endpoints (one tcp connection each) and the SIEVE-managed pool that caps how many are open.

An :class:`Endpoint` pipelines slices over one socket: a sender thread writes request headers
(and WRITE payloads, straight from the caller's memory) and a receiver thread matches responses
by request id and receives READ data straight into the destination window (recv_into, no extra
copy). When the connection breaks, every slice it had not finished is handed back through
``on_failure`` exactly once, for the backend to retry elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvflow.transfer.batch import RequestProgress
from kvflow.transfer.errors import EngineClosedError, ProtocolError
from kvflow.transfer.protocol import (
    MAX_CONTROL_PAYLOAD,
    REQUEST,
    RESPONSE,
    STATUS_ERROR_NAMES,
    Op,
    Status,
    recv_exact,
    recv_exact_into,
    send_parts,
)
from kvflow.transfer.sieve import SieveQueue

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndpointKey:
    """One connection: the peer address it goes to and the lane (connection index) it serves."""

    address: tuple[str, int]
    lane: int

    def __str__(self) -> str:
        return f"{self.address[0]}:{self.address[1]}#{self.lane}"


@dataclass
class EndpointStats:
    """Cumulative counters of one EndpointKey (kept across reconnects). Written by that
    endpoint's own threads only; read them for tests and metrics."""

    bytes_sent: int = 0
    bytes_received: int = 0
    slices: int = 0
    failures: int = 0


class Slice:
    """A piece of one request sent as one wire request. ``local`` is its own window."""

    __slots__ = (
        "attempts",
        "lane",
        "length",
        "local",
        "op",
        "peer",
        "progress",
        "remote_offset",
        "segment_id",
    )

    def __init__(
        self,
        op: Op,
        peer: str,
        segment_id: int,
        remote_offset: int,
        local: memoryview,
        progress: RequestProgress,
        lane: int,
    ) -> None:
        self.op = op
        self.peer = peer
        self.segment_id = segment_id
        self.remote_offset = remote_offset
        self.local = local
        self.length = local.nbytes
        self.progress = progress
        self.lane = lane
        self.attempts = 0


FailureHandler = Callable[["Endpoint", list[Slice], BaseException], None]
_STOP = object()


class Endpoint:
    """One connected socket with a sender and a receiver thread.

    ``send`` is thread-safe and returns False once the endpoint is retiring or dead (the caller
    then picks another). ``retire`` closes it once its queued work is done; ``fail`` drops the
    connection now and hands unfinished slices to ``on_failure``.
    """

    def __init__(
        self,
        key: EndpointKey,
        sock: socket.socket,
        stats: EndpointStats,
        on_failure: FailureHandler,
    ) -> None:
        self.key = key
        self.stats = stats
        self._sock = sock
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._inflight: dict[int, Slice] = {}
        self._outstanding = 0
        self._next_request_id = 1
        self._retiring = False
        self._dead = False
        self._error: BaseException | None = None
        self.last_progress = time.monotonic()
        self._threads_done = 0
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"kvflow-tx-{key}", daemon=True),
            threading.Thread(target=self._recv_loop, name=f"kvflow-rx-{key}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def usable(self) -> bool:
        with self._lock:
            return not (self._retiring or self._dead)

    @property
    def finished(self) -> bool:
        """True once both threads have exited (the socket is closed)."""
        return not any(thread.is_alive() for thread in self._threads)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._outstanding > 0

    def min_deadline(self) -> float | None:
        """The earliest request deadline among slices on the wire, None if idle."""
        with self._lock:
            if not self._inflight:
                return None
            return min(s.progress.deadline for s in self._inflight.values())

    def send(self, item: Slice) -> bool:
        """Queue ``item``; False (nothing done) if this endpoint no longer takes work.

        A READ is only a header, so it is written inline by the calling thread (no hand-off to
        the sender thread); a WRITE's payload goes through the sender thread so that submit does
        not block on it.
        """
        with self._lock:
            if self._retiring or self._dead:
                return False
            if self._outstanding == 0:
                self.last_progress = time.monotonic()
            self._outstanding += 1
        if item.op == Op.READ:
            self._transmit(item)
        else:
            self._queue.put(item)
        return True

    def send_reads(self, items: Sequence[Slice]) -> bool:
        """Queue READ slices whose request headers go out in ONE write (a header per slice
        costs a syscall and a GIL hand-off each: the bulk of the per-request cost of small
        reads). False (nothing done) if this endpoint no longer takes work."""
        with self._lock:
            if self._retiring or self._dead:
                return False
            if self._outstanding == 0:
                self.last_progress = time.monotonic()
            self._outstanding += len(items)
        error: OSError | None = None
        with self._send_lock:
            with self._lock:
                late = self._dead
                first = self._next_request_id
                if not late:
                    self._next_request_id += len(items)
                    for i, item in enumerate(items):
                        self._inflight[first + i] = item
            if not late:
                pack = REQUEST.pack
                headers = b"".join(
                    pack(s.op, 0, 0, s.segment_id, first + i, s.remote_offset, s.length)
                    for i, s in enumerate(items)
                )
                try:
                    self._sock.sendall(headers)
                except OSError as exc:
                    error = exc
        if late:
            self._on_failure(self, list(items), self._error or EngineClosedError("endpoint gone"))
        elif error is not None:
            self.fail(error)  # hands the slices (in flight) to on_failure with the others
        else:
            for item in items:
                item.progress.start()
        return True

    def retire(self) -> None:
        """Accept nothing new; close once every queued slice has completed."""
        with self._lock:
            self._retiring = True
            idle = self._outstanding == 0 and not self._dead
        if idle:
            self._close_quietly()

    def fail(self, error: BaseException) -> None:
        """Drop the connection; unfinished slices go to on_failure (once, from this call)."""
        with self._lock:
            if self._dead:
                return
            self._dead = True
            self._error = error
            orphans = list(self._inflight.values())
            self._inflight.clear()
        orphans.extend(self._drain_queue())
        self._shutdown()
        self.stats.failures += 1
        logger.info("endpoint %s failed (%s); %d slice(s) to retry", self.key, error, len(orphans))
        self._on_failure(self, orphans, error)

    def close(self) -> None:
        """Stop now (engine shutdown): unfinished slices fail with EngineClosedError."""
        self.fail(EngineClosedError(f"endpoint {self.key} closed"))

    def join(self, timeout: float = 5.0) -> None:
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _drain_queue(self) -> list[Slice]:
        drained: list[Slice] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return drained
            if isinstance(item, Slice):
                drained.append(item)

    def _close_quietly(self) -> None:
        with self._lock:
            if self._dead:
                return
            self._dead = True
        self._shutdown()

    def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._queue.put(_STOP)

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if not isinstance(item, Slice):
                break
            self._transmit(item)
        self._sock_close_when_both_done()

    def _transmit(self, item: Slice) -> None:
        """Register ``item`` as in flight and write its request (one writer at a time)."""
        error: OSError | None = None
        with self._send_lock:
            with self._lock:
                late = self._dead
                if not late:
                    request_id = self._next_request_id
                    self._next_request_id += 1
                    self._inflight[request_id] = item
            if not late:
                header = REQUEST.pack(
                    item.op, 0, 0, item.segment_id, request_id, item.remote_offset, item.length
                )
                try:
                    if item.op == Op.WRITE:
                        # counted before the payload goes out: the peer's answer (read by the
                        # receive thread) may complete the transfer before send_parts returns
                        self.stats.bytes_sent += item.length
                        try:
                            send_parts(self._sock, (header, item.local))
                        except OSError:
                            self.stats.bytes_sent -= item.length
                            raise
                    else:
                        self._sock.sendall(header)
                except OSError as exc:
                    error = exc
        if late:
            self._on_failure(self, [item], self._error or EngineClosedError("endpoint gone"))
        elif error is not None:
            self.fail(error)  # hands ``item`` (in flight) to on_failure with the others
        else:
            item.progress.start()

    def _recv_loop(self) -> None:
        header = bytearray(RESPONSE.size)
        header_view = memoryview(header)
        try:
            while True:
                recv_exact_into(self._sock, header_view)
                status, _reserved, request_id, length = RESPONSE.unpack(header)
                self._complete(status, request_id, length)
        except (OSError, ProtocolError) as exc:
            with self._lock:
                quiet = self._dead
            if not quiet:
                self.fail(exc)
        self._sock_close_when_both_done()

    def _complete(self, status: int, request_id: int, length: int) -> None:
        with self._lock:
            item = self._inflight.get(request_id)
        if item is None:
            raise ProtocolError(f"response for unknown request id {request_id}")
        if status == Status.OK:
            if item.op == Op.READ:
                if length != item.length:
                    raise ProtocolError(f"READ answered {length} bytes, asked {item.length}")
                recv_exact_into(self._sock, item.local)
                self.stats.bytes_received += length
            elif length:
                raise ProtocolError(f"WRITE ack carries {length} unexpected bytes")
            error = None
        else:
            if length > MAX_CONTROL_PAYLOAD:
                raise ProtocolError(f"error message of {length} bytes")
            message = recv_exact(self._sock, length).decode("utf-8", errors="replace")
            name = STATUS_ERROR_NAMES.get(status, "ProtocolError")
            error = f"{name}: {message}"
        with self._lock:
            if self._inflight.pop(request_id, None) is None:
                return  # failed concurrently; already handed to on_failure
            self._outstanding -= 1
            self.last_progress = time.monotonic()
            close_now = self._retiring and self._outstanding == 0
        self.stats.slices += 1
        if error is None:
            item.progress.add_bytes(item.length)
        else:
            item.progress.fail(error)
        item.progress.settle_slice()
        if close_now:
            self._close_quietly()

    def _sock_close_when_both_done(self) -> None:
        with self._lock:
            self._threads_done += 1
            last = self._threads_done == 2
        if last:
            self._sock.close()


class EndpointPool:
    """At most ``capacity`` usable endpoints by key; SIEVE picks which one to retire when full.

    Thread-safe. ``acquire`` connects outside the lock, so one slow connect does not stall
    others. A hit marks the key visited; a failed endpoint is removed without counting as an
    eviction (the paper: removed from the pool, re-established on the next transfer).
    """

    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        self._sieve: SieveQueue[EndpointKey] = SieveQueue(capacity)
        self._endpoints: dict[EndpointKey, Endpoint] = {}
        self.evictions: list[EndpointKey] = []

    def acquire(self, key: EndpointKey, connect: Callable[[], Endpoint]) -> Endpoint:
        """The pooled endpoint for ``key``, connecting one if needed; OSError from connect."""
        with self._lock:
            endpoint = self._endpoints.get(key)
            if endpoint is not None and endpoint.usable:
                self._sieve.touch(key)
                return endpoint
        fresh = connect()
        victim: Endpoint | None = None
        with self._lock:
            endpoint = self._endpoints.get(key)
            if endpoint is not None and endpoint.usable:
                self._sieve.touch(key)
                spare, fresh = fresh, endpoint
            else:
                spare = None
                self._sieve.remove(key)
                evicted_key = self._sieve.insert(key)
                if evicted_key is not None:
                    victim = self._endpoints.pop(evicted_key)
                    self.evictions.append(evicted_key)
                self._endpoints[key] = fresh
        if spare is not None:
            spare.retire()
        if victim is not None:
            logger.debug("endpoint pool full: evicting %s for %s", victim.key, key)
            victim.retire()
        return fresh

    def remove(self, endpoint: Endpoint) -> None:
        """Forget ``endpoint`` if it is the pooled one for its key."""
        with self._lock:
            if self._endpoints.get(endpoint.key) is endpoint:
                del self._endpoints[endpoint.key]
                self._sieve.remove(endpoint.key)

    def order(self) -> list[EndpointKey]:
        """Pooled keys, oldest first (SIEVE queue order)."""
        with self._lock:
            return self._sieve.order()

    def endpoints(self) -> list[Endpoint]:
        with self._lock:
            return list(self._endpoints.values())

    def drain(self) -> list[Endpoint]:
        """Remove and return every pooled endpoint (for close)."""
        with self._lock:
            endpoints = list(self._endpoints.values())
            self._endpoints.clear()
            for key in self._sieve.order():
                self._sieve.remove(key)
            return endpoints
