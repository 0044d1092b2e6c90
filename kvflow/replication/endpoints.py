"""Failover between the metadata replicas' gRPC endpoints (the transport of RemoteMetadata).

:class:`Endpoints` keeps one channel per replica address and calls a ``MetadataService``
method on one replica after another until one answers: writes go first to the replica it
knows as the leader (learned from ``Status`` replies and from the ``kvflow-leader`` hint of
an UNAVAILABLE reply), reads first to the replica that answered last. UNAVAILABLE and
DEADLINE_EXCEEDED are retried on the next replica, then again after a short backoff, until
the call's budget (``timeout_s``) is spent; then ``MetadataUnavailableError`` names every
address and what it answered. One attempt of a read waits at most ``read_attempt_timeout_s``
(any replica answers a read from memory; a paused one must not hold it for a write's
``attempt_timeout_s``), and each replica has a ``CircuitBreaker``: a replica that failed or
timed out is tried last until a half-open probe finds it answering again, so a paused
leader costs the first call one short attempt and the next ones nothing. INVALID_ARGUMENT
raises ``ValueError``. Only idempotent commands go through here (all of the metadata's are),
so a retry after an unknown outcome is safe.

Thread-safety: every method may be called from any thread; gRPC channels are thread-safe
and the little routing state is under a lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from kvflow.replication.breaker import BreakerConfig, BreakerState, CircuitBreaker
from kvflow.replication.config import check_address
from kvflow.replication.errors import MetadataUnavailableError, ReplicationError
from kvflow.replication.wire import GRPC_OPTIONS, LEADER_METADATA_KEY, pb2, pb2_grpc
from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_channel

logger = logging.getLogger(__name__)

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    *GRPC_OPTIONS,
    # Reconnect to a restarted replica within ~0.1-1 s, not gRPC's default of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

_BACKOFF_S = (0.02, 0.05, 0.1, 0.2)
_DISCOVER_TIMEOUT_S = 1.0
DEFAULT_READ_ATTEMPT_TIMEOUT_S = 0.5


class Endpoints:
    """Channels to every replica, the known leader, and the retrying call (module doc)."""

    def __init__(
        self,
        addresses: Sequence[str],
        timeout_s: float,
        attempt_timeout_s: float,
        read_attempt_timeout_s: float = DEFAULT_READ_ATTEMPT_TIMEOUT_S,
        breaker: BreakerConfig | None = None,
    ):
        if isinstance(addresses, str) or not addresses:
            raise ValueError("addresses: expected a non-empty sequence of 'host:port' strings")
        for address in addresses:
            check_address("addresses", address)
        if len(set(addresses)) != len(addresses):
            raise ValueError("addresses: contains duplicates")
        self.addresses: tuple[str, ...] = tuple(addresses)
        self._timeout_s = timeout_s
        self._attempt_timeout_s = attempt_timeout_s
        self._read_attempt_timeout_s = min(read_attempt_timeout_s, attempt_timeout_s)
        self.breakers = {
            a: CircuitBreaker(breaker or BreakerConfig(failure_threshold=1)) for a in addresses
        }
        self._lock = threading.Lock()
        self._stubs: dict[str, Any] = {}
        self._channels: list[grpc.Channel] = []
        self._closed = False
        self._raft_to_grpc: dict[str, str] = {}
        self._leader_raft: str | None = None
        self._last_good: str = self.addresses[0]

    # ------------------------------------------------------------------ routing state

    def leader_raft(self) -> str | None:
        """The leader's Raft address as last learned, or None."""
        with self._lock:
            return self._leader_raft

    def _leader_known(self) -> bool:
        with self._lock:
            return self._leader_raft is not None and self._leader_raft in self._raft_to_grpc

    def note_status(self, grpc_address: str, status: Any) -> None:
        """Learn a replica's Raft address and its idea of the leader from a Status reply."""
        with self._lock:
            if status.raft_address:
                self._raft_to_grpc[status.raft_address] = grpc_address
            if status.leader:
                self._leader_raft = status.leader

    def _candidates(self, write: bool) -> list[str]:
        with self._lock:
            first: list[str] = []
            if write and self._leader_raft is not None:
                leader = self._raft_to_grpc.get(self._leader_raft)
                if leader is not None:
                    first.append(leader)
            first.append(self._last_good)
        rest = [a for a in self.addresses if a not in first]
        ordered = list(dict.fromkeys(first)) + rest
        # A replica whose breaker is open goes last: tried only when no other answered. A
        # half-open one is in its place again: whichever call reaches it is the probe.
        allowed = [a for a in ordered if self.breakers[a].state is not BreakerState.OPEN]
        return allowed + [a for a in ordered if a not in allowed]

    def _failed(self, address: str, exc: grpc.RpcError) -> None:
        hint = None
        for key, value in exc.trailing_metadata() or ():
            if key == LEADER_METADATA_KEY:
                hint = value
        with self._lock:
            if self._raft_to_grpc.get(self._leader_raft or "") == address or hint:
                self._leader_raft = hint

    # ------------------------------------------------------------------ calls

    def stub(self, address: str) -> Any:
        with self._lock:
            if self._closed:
                raise MetadataUnavailableError("metadata client is closed")
            stub = self._stubs.get(address)
            if stub is None:
                channel = cluster_channel(address, process_secret(), _CHANNEL_OPTIONS)
                self._channels.append(channel)
                stub = self._stubs[address] = pb2_grpc.MetadataServiceStub(channel)
            return stub

    def status_of(self, address: str, timeout: float) -> Any:
        """One Status call to ``address`` (no retry); learns from the reply. Raises
        grpc.RpcError."""
        reply = self.stub(address).Status(pb2.StatusRequest(), timeout=timeout)
        self.note_status(address, reply)
        return reply

    def discover(self) -> None:
        """Ask every replica for its Status (short timeout each); ignore the silent ones."""
        for address in self.addresses:
            try:
                self.status_of(address, _DISCOVER_TIMEOUT_S)
            except grpc.RpcError:
                continue

    def call(self, method: str, request: Any, write: bool) -> Any:
        """Call ``method`` on the first replica that answers (module docstring)."""
        deadline = time.monotonic() + self._timeout_s
        answers: dict[str, str] = {}
        attempt_s = self._attempt_timeout_s if write else self._read_attempt_timeout_s
        for attempt in itertools.count():
            for address in self._candidates(write):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    reply = getattr(self.stub(address), method)(
                        request, timeout=min(attempt_s, remaining)
                    )
                except grpc.RpcError as exc:
                    self._raise_unless_retryable(method, address, exc)
                    answers[address] = f"{exc.code().name}: {exc.details()}"
                    self._failed(address, exc)
                    if self.breakers[address].failure():
                        logger.warning(
                            "metadata replica %s failed %s (%s): tried last for a while",
                            address,
                            method,
                            exc.code().name,
                        )
                    continue
                self.breakers[address].success()
                with self._lock:
                    self._last_good = address
                return reply
            if time.monotonic() >= deadline:
                break
            time.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            if write and not self._leader_known():
                self.discover()
        raise MetadataUnavailableError(
            f"no metadata replica answered {method} within {self._timeout_s}s (addresses: "
            + "; ".join(f"{a}: {answers.get(a, 'not tried')}" for a in self.addresses)
            + ")"
        )

    @staticmethod
    def _raise_unless_retryable(method: str, address: str, exc: grpc.RpcError) -> None:
        code = exc.code()
        if code in RETRYABLE:
            return
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise ValueError(exc.details()) from None
        if code == grpc.StatusCode.CANCELLED:
            raise MetadataUnavailableError(f"metadata {method} cancelled at {address}") from None
        raise ReplicationError(
            f"metadata {method} failed at {address}: {code.name}: {exc.details()}"
        ) from None

    def close(self) -> None:
        """Close every channel (idempotent); later calls raise MetadataUnavailableError."""
        with self._lock:
            self._closed = True
            channels, self._channels = self._channels, []
            self._stubs.clear()
        for channel in channels:
            channel.close()
