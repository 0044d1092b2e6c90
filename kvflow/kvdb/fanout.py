"""AdminPeers: the kvdb admin views of a server that holds no blocks itself (a router), answered
by the servers that hold them, and the merging of several KVAdmin answers into one.

The metadata group records who holds a block but not whose block it is, so a router cannot
filter its own view by tenant. ``KVAdmin`` on a source with ``peers`` instead asks every peer's
KVAdmin service (a node's control port) for ``Hot``, ``Replicas`` and ``Stats`` at once, with a
short deadline, over a cluster channel: the cluster token makes it an admin there, so the
caller's tenant goes down in the request's ``tenant`` filter field (the node trusts that field
only from an admin). A peer that fails or is late is skipped: named in the reply's
``skipped_nodes`` and logged. A peer answering NOT_FOUND has no such shard (not a failure).

Merging: Hot, every block sorted by hits, the top n; Replicas, the union of the rows, the
largest replica target; Stats, the rows of every shard and the sum of the totals.

Thread-safety: ``ask`` may run from several threads at once (channels are made under a lock);
``close`` closes every channel. The merge functions are pure.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvflow.kvdb.proto import pb2, pb2_grpc
from kvflow.security import ClusterSecret, process_secret
from kvflow.security.grpc_auth import cluster_channel

logger = logging.getLogger(__name__)

DEFAULT_PEER_TIMEOUT_S = 2.0
"""How long a fan-out waits for each peer (they are asked at once)."""

SUMMED_STATS = ("puts", "rejected_puts", "gets", "hits", "dram_hits", "ssd_hits", "misses")
SUMMED_STATS += ("corruptions", "bytes_read", "bytes_written", "events_dropped")
"""The ShardStats fields a total adds up (hit_rate is recomputed)."""


@dataclass(frozen=True)
class AdminPeer:
    """A server to ask: ``node`` (its id, as named in replies and logs) and the HOST:PORT of
    its KVAdmin service."""

    node: str
    address: str


@dataclass(frozen=True)
class PeerAnswers:
    """What the peers said to one request: the ``replies`` of those that answered, the
    ``skipped`` nodes (failed or late) and how many had no such shard (``not_found``)."""

    replies: list[Any] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    not_found: int = 0


class AdminPeers:
    """Asks the current peers (``peers()``, read on every call) one KVAdmin RPC at once.

    ``timeout_s``: each peer's deadline (> 0). ``secret``: the cluster's (None: this
    process's); ``channel_of``: how a channel to an address is made (default: a cluster
    channel, over TLS when this process is configured for it)."""

    def __init__(
        self,
        peers: Callable[[], Sequence[AdminPeer]],
        *,
        timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
        secret: ClusterSecret | None = None,
        channel_of: Callable[[str], grpc.Channel] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._peers = peers
        self.timeout_s = timeout_s
        self._channel_of = channel_of or (
            lambda address: cluster_channel(address, secret or process_secret())
        )
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _stubs(self, peers: Sequence[AdminPeer]) -> list[Any]:
        """A KVAdmin stub per peer; channels to addresses no longer listed are closed."""
        wanted = {p.address for p in peers}
        with self._lock:
            if self._closed:
                raise RuntimeError("AdminPeers is closed")
            for address in [a for a in self._channels if a not in wanted]:
                self._channels.pop(address).close()
            for address in wanted - self._channels.keys():
                self._channels[address] = self._channel_of(address)
            return [pb2_grpc.KVAdminStub(self._channels[p.address]) for p in peers]

    def ask(self, rpc: str, request: Any) -> PeerAnswers:
        """Call ``rpc`` ("Hot", "Replicas" or "Stats") on every peer at once and wait for each
        at most ``timeout_s``. Never raises for a peer's failure (it is skipped and logged)."""
        peers = list(self._peers())
        stubs = self._stubs(peers)
        calls = [getattr(stub, rpc).future(request, timeout=self.timeout_s) for stub in stubs]
        replies: list[Any] = []
        skipped: list[str] = []
        not_found = 0
        for peer, call in zip(peers, calls, strict=True):
            try:
                replies.append(call.result())
            except grpc.RpcError as err:
                code = err.code() if isinstance(err, grpc.Call) else None
                if code is grpc.StatusCode.NOT_FOUND:
                    not_found += 1
                    continue
                details = err.details() if isinstance(err, grpc.Call) else str(err)
                reason = code.name if code is not None else "error"
                logger.warning(
                    "kvdb admin fan-out: rpc=%s node=%s skipped: %s %s",
                    rpc,
                    peer.node,
                    reason,
                    details,
                )
                skipped.append(peer.node)
        return PeerAnswers(replies, skipped, not_found)

    def close(self) -> None:
        """Close every channel; later ``ask`` calls raise RuntimeError. Idempotent."""
        with self._lock:
            self._closed = True
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


def total_of(rows: Sequence[Any]) -> Any:
    """The ``total`` ShardStats of ``rows`` (ShardStats, or totals of several answers)."""
    total = pb2.ShardStats(shard="total")
    for name in SUMMED_STATS:
        setattr(total, name, sum(getattr(r, name) for r in rows))
    if total.hits + total.misses:
        total.hit_rate = total.hits / (total.hits + total.misses)
    return total


def merge_hot(replies: Sequence[Any], n: int) -> Any:
    """One HotResponse: every block of ``replies``, the most read first, the top ``n``."""
    rows = [b for r in replies for b in r.blocks]
    rows.sort(key=lambda b: -b.hits)  # stable: each answer's own order breaks ties
    return pb2.HotResponse(blocks=rows[:n])


def merge_replicas(key: str, replies: Sequence[Any]) -> Any:
    """One ReplicasResponse: the union of the rows (metadata rows first), the largest replica
    target; an answer with no rows anywhere is the answer for a key nobody holds."""
    seen: dict[tuple[str, str, str, str], Any] = {}
    for reply in replies:
        for r in reply.replicas:
            seen.setdefault((r.source, r.node, r.shard, r.tier), r)
    rows = sorted(seen.values(), key=lambda r: (r.source != "metadata", r.node, r.shard))
    return pb2.ReplicasResponse(
        key=key,
        replicas=rows,
        replica_target=max((r.replica_target for r in replies), default=0),
        has_metadata=any(r.has_metadata for r in replies),
    )


def merge_stats(replies: Sequence[Any]) -> Any:
    """One StatsResponse: every answer's shard and tenant rows (by node, then shard) and the
    sum of their totals."""
    rows = sorted((s for r in replies for s in r.shards), key=lambda s: (s.node, s.shard))
    tenants = sorted((t for r in replies for t in r.tenants), key=lambda t: (t.node, t.shard))
    return pb2.StatsResponse(
        shards=rows, total=total_of([r.total for r in replies]), tenants=tenants
    )


__all__ = [
    "DEFAULT_PEER_TIMEOUT_S",
    "AdminPeer",
    "AdminPeers",
    "PeerAnswers",
    "merge_hot",
    "merge_replicas",
    "merge_stats",
    "total_of",
]
