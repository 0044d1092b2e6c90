"""Calls that survive a router loss: several server addresses, failover between them, retries
of an unreachable server with backoff, and the caller's API key on every call.

``Channels`` keeps one channel per server and drops a failed server's channel (a new one
connects at once when the server is back). ``Retry`` decides, for one call, which server to
try next and how long to pause. ``FailoverStub`` makes every unary method of a generated stub
go through them; ``InferenceClient`` (client.py) uses the same pieces for its streams.

Only UNAVAILABLE (connection refused, a router that died, a name that does not resolve) moves
a call to the next server; every other status is the answer. A unary call that met
UNAVAILABLE after the server received it (the server died before answering) may therefore
run twice; warm-up submits and kvdb evictions tolerate that (a second job; a second eviction
of already evicted bytes).

``api_key``: sent as ``authorization: Bearer KEY``; None reads ``KVFLOW_API_KEY`` (``""``:
none at all).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

logger = logging.getLogger(__name__)

API_KEY_ENV = "KVFLOW_API_KEY"

# The server is gone or not reachable: the call may go to another one. Every other status (a
# bad request, an SLO rejection, a deadline) is the answer and is raised to the caller.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
MAX_PAUSE_S = 2.0


def resolve_api_key(api_key: str | None) -> str | None:
    """``api_key``, or ``KVFLOW_API_KEY`` when None; an empty key is no key."""
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV)
    return api_key or None


def bearer(api_key: str | None) -> list[tuple[str, str]] | None:
    """The call metadata that carries ``api_key`` (None: nothing to add)."""
    return [("authorization", f"Bearer {api_key}")] if api_key else None


def parse_servers(text: str) -> list[str]:
    """Parse "HOST:PORT[,HOST:PORT...]"; a ValueError names a bad entry."""
    servers = [s.strip() for s in text.split(",") if s.strip()]
    if not servers:
        raise ValueError("no server given (expected HOST:PORT[,HOST:PORT...])")
    for server in servers:
        host, sep, port = server.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad server address {server!r} (expected HOST:PORT)")
    return servers


class Channels:
    """One channel per server, opened on first use by ``channel_of``. Thread-safe."""

    def __init__(self, servers: Sequence[str], channel_of: Callable[[str], grpc.Channel]) -> None:
        if not servers:
            raise ValueError("at least one server address is needed")
        self.servers = list(servers)
        self._channel_of = channel_of
        self._open: dict[str, grpc.Channel] = {}
        self._retired: list[grpc.Channel] = []
        self._lock = threading.Lock()
        self.preferred = 0  # the index of the server that answered last

    def get(self, server: str) -> grpc.Channel:
        with self._lock:
            channel = self._open.get(server)
            if channel is None:
                channel = self._open[server] = self._channel_of(server)
        return channel

    def forget(self, server: str) -> None:
        """Drop a failed server's channel: a new one connects at once when the server is back,
        where the old one could be waiting out its reconnect backoff."""
        with self._lock:
            channel = self._open.pop(server, None)
            if channel is not None:  # closed with the rest: other calls may still use it
                self._retired.append(channel)

    def close(self) -> None:
        with self._lock:
            channels = [*self._open.values(), *self._retired]
            self._open, self._retired = {}, []
        for channel in channels:
            channel.close()


class Retry:
    """The servers one call tries, in order from the preferred one, round after round (a pause
    before each new round, doubling from ``backoff_s`` up to 2 s), for as long as
    ``retry_for_s`` passes without progress (``progress()`` restarts the window) and the call's
    deadline allows. ``max_attempts`` caps the tries (None: no cap)."""

    def __init__(
        self,
        channels: Channels,
        deadline: float,
        backoff_s: float,
        retry_for_s: float,
        max_attempts: int | None = None,
    ) -> None:
        self._channels = channels
        self._deadline = deadline
        self._backoff_s = backoff_s
        self._retry_for_s = retry_for_s
        self._max_attempts = max_attempts
        self._first = channels.preferred
        self._pause = backoff_s
        self._failing_since: float | None = None
        self.attempt = 0
        self.last_error: grpc.RpcError | None = None  # the latest retryable failure

    def next_server(self, what: str) -> tuple[int, str, float]:
        """(index, server, seconds left) of the next try; TimeoutError past the deadline."""
        servers = self._channels.servers
        index = (self._first + self.attempt) % len(servers)
        if self.attempt and self.attempt % len(servers) == 0:  # a new round: every one failed
            time.sleep(min(self._pause, max(0.0, self._deadline - time.monotonic())))
            self._pause = min(MAX_PAUSE_S, self._pause * 2 or 0.1)
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{what}: no server answered in time ({', '.join(servers)})")
        return index, servers[index], remaining

    def progress(self) -> None:
        """The call got somewhere (tokens came back): the retry window starts again."""
        self._failing_since, self._pause = None, self._backoff_s

    def failed(self, index: int, server: str, err: grpc.RpcError) -> None:
        """Re-raise ``err`` unless the call may go on to the next server."""
        if err.code() not in RETRYABLE:
            raise err
        self.last_error = err
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        self.attempt += 1
        out_of_attempts = self._max_attempts is not None and self.attempt >= self._max_attempts
        if out_of_attempts or now - self._failing_since > self._retry_for_s:
            raise err
        self._channels.forget(server)
        servers = self._channels.servers
        self._channels.preferred = (index + 1) % len(servers)
        logger.warning(
            "server %s unavailable (%s); trying %s",
            server,
            err.details(),
            servers[self._channels.preferred],
        )

    def succeeded(self, index: int) -> None:
        self._channels.preferred = index


class FailoverStub:
    """``stub_class`` (a generated gRPC stub) over ``servers``: every unary method call goes to
    the server that answered last and fails over as the module docstring says; the caller's
    ``timeout`` bounds the whole call, retries included (past it, the last UNAVAILABLE is
    raised). ``channel_of(server)`` opens a
    channel (the caller decides TLS and the cluster token). Thread-safe; close it (or use it
    as a context manager)."""

    def __init__(
        self,
        servers: Sequence[str],
        stub_class: Callable[[grpc.Channel], Any],
        channel_of: Callable[[str], grpc.Channel],
        api_key: str | None = None,
        retry_for_s: float = 15.0,
        backoff_s: float = 0.25,
    ) -> None:
        if backoff_s < 0 or retry_for_s < 0:
            raise ValueError("backoff_s and retry_for_s must be >= 0")
        self.channels = Channels(servers, channel_of)
        self._stub_class = stub_class
        self._metadata = bearer(resolve_api_key(api_key))
        self.retry_for_s = retry_for_s
        self.backoff_s = backoff_s

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(request: Any, timeout: float = 60.0, **kw: Any) -> Any:
            return self._call(name, request, timeout, kw)

        return call

    def _call(self, name: str, request: Any, timeout: float, kw: dict[str, Any]) -> Any:
        retry = Retry(self.channels, time.monotonic() + timeout, self.backoff_s, self.retry_for_s)
        if self._metadata is not None:
            kw = {**kw, "metadata": [*kw.get("metadata", ()), *self._metadata]}
        while True:
            try:
                index, server, remaining = retry.next_server(name)
            except TimeoutError:
                if retry.last_error is not None:  # the call's own deadline ran out: say why
                    raise retry.last_error from None
                raise
            method = getattr(self._stub_class(self.channels.get(server)), name)
            try:
                reply = method(request, timeout=remaining, **kw)
            except grpc.RpcError as err:
                retry.failed(index, server, err)
                continue
            retry.succeeded(index)
            return reply

    def close(self) -> None:
        self.channels.close()

    def __enter__(self) -> FailoverStub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
