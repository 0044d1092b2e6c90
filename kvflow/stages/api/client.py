"""A Generate client that fails over between routers.

Several routers may serve one cluster (`kvflow serve --role router`, `kvflow cluster
--routers N`). ``InferenceClient`` sends a request to one of them; when that router cannot be
reached or dies in the middle of the answer (UNAVAILABLE), it sends the request again to the
next one with ``skip_tokens`` set to the tokens already received, so the caller sees one
uninterrupted answer. This is exact because generation is deterministic: greedy decoding is,
and for sampling the client fixes a seed before the first attempt when the caller gave none.

    with InferenceClient(["127.0.0.1:50051", "127.0.0.1:50052"]) as client:
        for msg in client.generate(request, timeout=60):
            ...
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from kvflow.security.tls import TlsSettings
from kvflow.security.tls import channel as channel_to
from kvflow.stages.api import pb2, pb2_grpc

logger = logging.getLogger(__name__)

# The router is gone or not reachable: the request may go to another one. Every other status
# (a bad request, an SLO rejection, a deadline) is the answer and is raised to the caller.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


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


class InferenceClient:
    """Generate with failover over ``servers`` (router addresses serving the same cluster).

    A request that meets an unreachable or dying router goes to the next one, round after
    round (a short pause before each new round, doubling up to 2 s), for as long as
    ``retry_for_s`` passes without a token coming back — long enough for a supervisor to
    restart the only router. ``max_attempts`` caps the sends of one request (None: no cap).
    Thread-safe for concurrent ``generate`` calls (one gRPC channel per server, shared).
    ``tls``: TLS to the routers (a CA to verify them); None: this process's ``KVFLOW_TLS_*``."""

    def __init__(
        self,
        servers: Sequence[str],
        max_attempts: int | None = None,
        backoff_s: float = 0.25,
        retry_for_s: float = 15.0,
        seed: int | None = None,
        tls: TlsSettings | None = None,
    ) -> None:
        if not servers:
            raise ValueError("InferenceClient needs at least one server address")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if backoff_s < 0 or retry_for_s < 0:
            raise ValueError("backoff_s and retry_for_s must be >= 0")
        self.servers = list(servers)
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.retry_for_s = retry_for_s
        self._rng = random.Random(seed)
        self._tls = tls
        self._channels: dict[str, grpc.Channel] = {}
        self._retired: list[grpc.Channel] = []
        self._lock = threading.Lock()
        self._preferred = 0
        self.failovers = 0  # requests resent to another router, over this client's life

    def _stub(self, server: str) -> Any:
        with self._lock:
            channel = self._channels.get(server)
            if channel is None:
                channel = self._channels[server] = channel_to(server, (), self._tls)
        return pb2_grpc.InferenceStub(channel)

    def _forget(self, server: str) -> None:
        """Drop a failed server's channel: a new one connects at once when the server is back,
        where the old one could be waiting out its reconnect backoff."""
        with self._lock:
            channel = self._channels.pop(server, None)
            if channel is not None:  # closed with the client: other calls may still use it
                self._retired.append(channel)

    def generate(self, request: Any, timeout: float = 600.0) -> Iterator[Any]:
        """Yield the GenerateResponse messages of one answer, across router failures."""
        req = pb2.GenerateRequest()
        req.CopyFrom(request)
        if req.sampling.temperature > 0 and not req.sampling.HasField("seed"):
            req.sampling.seed = self._rng.getrandbits(63)  # a resent request samples the same
        deadline = time.monotonic() + timeout
        received = 0
        first = self._preferred
        failing_since: float | None = None
        pause = self.backoff_s
        attempt = 0
        while True:
            index = (first + attempt) % len(self.servers)
            server = self.servers[index]
            if attempt and attempt % len(self.servers) == 0:  # a new round: every server failed
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(2.0, pause * 2 or 0.1)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no router answered within {timeout} s")
            req.skip_tokens = request.skip_tokens + received
            if attempt and request.request_id:  # a fresh id: the old one may linger on a node
                req.request_id = f"{request.request_id}-r{attempt}"
            before = received
            try:
                for msg in self._stub(server).Generate(req, timeout=remaining):
                    received += len(msg.token_ids)
                    yield msg
                self._preferred = index
                return
            except grpc.RpcError as err:
                code = err.code()
                if code not in RETRYABLE:
                    raise
                now = time.monotonic()
                if failing_since is None or received > before:  # progress restarts the window
                    failing_since, pause = now, self.backoff_s
                attempt += 1
                out_of_attempts = self.max_attempts is not None and attempt >= self.max_attempts
                if out_of_attempts or now - failing_since > self.retry_for_s:
                    raise
                self._forget(server)
                self.failovers += 1
                self._preferred = (index + 1) % len(self.servers)
                logger.warning(
                    "router %s failed (%s: %s) after %d tokens; resending to %s",
                    server,
                    code.name,
                    err.details(),
                    received,
                    self.servers[self._preferred],
                )

    def close(self) -> None:
        with self._lock:
            channels = [*self._channels.values(), *self._retired]
            self._channels, self._retired = {}, []
        for channel in channels:
            channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
