"""RemoteMetadata: the metadata group's write API over gRPC, for processes that hold no replica.

It has the same lifecycle and write methods as :class:`MetadataGroup` (``start``,
``wait_ready``, ``close``, ``record_batch``, ``replace_holdings``, ``set_replica_target``,
``register_node``, ``heartbeat``, ``reap_dead_nodes``, ``view``), so kvdb's ``open_store``,
``MetadataSync`` and ``MetadataReplicas`` take either. Arguments are validated here with the
group's own checks (``TypeError``/``ValueError``, nothing sent); a write returns once the
replica that served it has applied it. Failover and retries: see ``endpoints.py``.

Differences from an in-process replica, all from retrying an unknown outcome: a retried
``heartbeat`` may answer True although the first, lost attempt re-registered the node (it
is registered either way); a retried ``reap_dead_nodes`` may return fewer nodes than were
reaped. ``now=None`` (allowed here) means the serving replica's clock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import grpc

from kvflow.replication.codec import check_key, check_keys, check_node, check_now, split_stored
from kvflow.replication.endpoints import Endpoints
from kvflow.replication.errors import MetadataTimeoutError
from kvflow.replication.jobs import JobRecord
from kvflow.replication.remote_view import RemoteMetadataView
from kvflow.replication.types import NodeId, Tier
from kvflow.replication.wire import keys_msg, pb2

DEFAULT_TIMEOUT_S = 20.0
DEFAULT_ATTEMPT_TIMEOUT_S = 6.0
DEFAULT_CACHE_TTL_S = 0.5


def _now_field(now: float | None) -> dict[str, float]:
    return {} if now is None else {"now": check_now(now)}


class RemoteMetadata:
    """A client of the metadata service on ``addresses`` (the replicas' gRPC endpoints).

    ``timeout_s``: budget of one call including failover and retries (a leader election
    takes about one Raft election timeout); ``attempt_timeout_s``: deadline of one RPC
    (above the servers' ``commit_timeout_s``, 5 s by default, so a slow commit is not cut
    short); ``cache_ttl_s``: how long the view may serve a key's holders from its cache (0:
    never). Bad values raise ValueError naming the argument.

    Thread-safe. ``close()`` (idempotent) closes the channels; calls after it raise
    ``MetadataUnavailableError``. Errors: ``MetadataUnavailableError`` when no replica
    answers within ``timeout_s`` (names every address), ``ValueError``/``TypeError`` for bad
    input, ``ReplicationError`` for any other server failure.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        attempt_timeout_s: float = DEFAULT_ATTEMPT_TIMEOUT_S,
        cache_ttl_s: float = DEFAULT_CACHE_TTL_S,
    ) -> None:
        for name, value, low in (
            ("timeout_s", timeout_s, 0.0),
            ("attempt_timeout_s", attempt_timeout_s, 0.0),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= low:
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
        if isinstance(cache_ttl_s, bool) or not isinstance(cache_ttl_s, int | float):
            raise ValueError(f"cache_ttl_s: must be a number of seconds >= 0, got {cache_ttl_s!r}")
        if cache_ttl_s < 0:
            raise ValueError(f"cache_ttl_s: must be >= 0, got {cache_ttl_s!r}")
        self._endpoints = Endpoints(addresses, float(timeout_s), float(attempt_timeout_s))
        self._view = RemoteMetadataView(self._endpoints, float(cache_ttl_s))

    @property
    def addresses(self) -> tuple[str, ...]:
        return self._endpoints.addresses

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Open channels and learn the replicas' Raft addresses and the leader (replicas
        that do not answer now are asked again later). Never raises for an absent replica."""
        self._endpoints.discover()

    def wait_ready(self, timeout: float) -> None:
        """Block until some replica reports a known leader and itself caught up. Raises
        MetadataTimeoutError naming the addresses after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last: dict[str, str] = {}
        while True:
            for address in self.addresses:
                try:
                    status = self._endpoints.status_of(address, min(1.0, max(timeout, 0.1)))
                except grpc.RpcError as exc:
                    last[address] = exc.code().name
                    continue
                if status.ready and status.leader:
                    return
                last[address] = f"leader={status.leader or 'none'} ready={status.ready}"
            if time.monotonic() >= deadline:
                raise MetadataTimeoutError(
                    f"metadata group not ready after {timeout}s: "
                    + "; ".join(f"{a}: {last.get(a, 'not tried')}" for a in self.addresses)
                )
            time.sleep(0.05)

    def close(self) -> None:
        """Close the channels. Idempotent; never raises."""
        self._endpoints.close()

    def __enter__(self) -> RemoteMetadata:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ writes

    def record_batch(
        self,
        node: NodeId,
        stored: Sequence[tuple[bytes, Tier]],
        removed: Sequence[bytes],
        now: float | None = None,
    ) -> None:
        """As :meth:`MetadataGroup.record_batch`: one RPC; one Raft entry while the keys fit
        in the servers' ``max_entry_bytes``. An empty batch sends nothing."""
        check_node(node)
        keys, tiers = split_stored(stored)
        gone = check_keys(removed, "removed")
        fields = _now_field(now)
        if not keys and not gone:
            return
        request = pb2.RecordBatchRequest(
            node=node, stored=keys_msg(keys), stored_tiers=tiers, removed=keys_msg(gone), **fields
        )
        self._write("RecordBatch", request)
        self._view.forget(keys + gone)

    def replace_holdings(
        self, node: NodeId, holdings: Sequence[tuple[bytes, Tier]], now: float | None = None
    ) -> None:
        """As :meth:`MetadataGroup.replace_holdings` (one RPC)."""
        check_node(node)
        keys, tiers = split_stored(holdings)
        request = pb2.ReplaceHoldingsRequest(
            node=node, holdings=keys_msg(keys), tiers=tiers, **_now_field(now)
        )
        self._write("ReplaceHoldings", request)
        self._view.forget_all()

    def set_replica_target(self, key: bytes, n: int, now: float | None = None) -> None:
        """As :meth:`MetadataGroup.set_replica_target`."""
        check_key(key)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: replica target must be an int >= 1, got {n!r}")
        if n >= 1 << 32:
            raise ValueError(f"n: replica target must be below 2**32, got {n!r}")
        self._write(
            "SetReplicaTarget", pb2.SetReplicaTargetRequest(key=key, target=n, **_now_field(now))
        )

    def register_node(
        self, node: NodeId, address: str, kind: str, now: float | None = None
    ) -> None:
        """As :meth:`MetadataGroup.register_node`."""
        check_node(node)
        if not isinstance(address, str) or not isinstance(kind, str):
            raise TypeError("address and kind: expected str")
        request = pb2.RegisterNodeRequest(node=node, address=address, kind=kind, **_now_field(now))
        self._write("RegisterNode", request)

    def heartbeat(self, node: NodeId, now: float | None = None) -> bool:
        """As :meth:`MetadataGroup.heartbeat` (see the module docstring on retries)."""
        check_node(node)
        reply = self._write("Heartbeat", pb2.HeartbeatRequest(node=node, **_now_field(now)))
        return bool(reply.known)

    def reap_dead_nodes(self, now: float | None = None) -> list[NodeId]:
        """As :meth:`MetadataGroup.reap_dead_nodes`, with the servers' ``node_dead_after_s``
        (see the module docstring on retries)."""
        reply = self._write("ReapDeadNodes", pb2.ReapDeadNodesRequest(**_now_field(now)))
        self._view.forget_all()
        return [NodeId(node) for node in reply.reaped]

    def job_write(
        self,
        op: str,
        job_id: str,
        owner: str,
        now: float | None = None,
        *,
        doc: bytes = b"",
        events: Sequence[bytes] = (),
        lease_s: float = 0.0,
    ) -> bool:
        """As :meth:`MetadataGroup.job_write` (``now`` None: the serving replica's clock)."""
        request = pb2.JobWriteRequest(
            op=op,
            job_id=job_id,
            owner=owner,
            doc=doc,
            events=list(events),
            lease_s=lease_s,
            **_now_field(now),
        )
        return bool(self._write("JobWrite", request).ok)

    def job_read(self, job_id: str = "") -> tuple[list[JobRecord], float]:
        """Every job's record (or ``job_id``'s) and the serving replica's clock."""
        # Leader first (as a write): a follower may not have applied the latest events yet.
        reply = self._endpoints.call("JobRead", pb2.JobReadRequest(job_id=job_id), write=True)
        jobs = [
            JobRecord(r.job_id, r.doc, r.created_at, r.owner, r.lease_until, tuple(r.events))
            for r in reply.jobs
        ]
        return jobs, reply.now

    # ------------------------------------------------------------------ reads

    def view(self) -> RemoteMetadataView:
        """The read-only view over gRPC (the same object each call)."""
        return self._view

    def is_leader(self) -> bool:
        """Always False: a client is not a replica."""
        return False

    def leader(self) -> str | None:
        """The leader's Raft address as last learned from a replica, or None."""
        return self._endpoints.leader_raft()

    def _write(self, method: str, request: Any) -> Any:
        return self._endpoints.call(method, request, write=True)
