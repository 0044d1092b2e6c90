"""RemoteMetadataView: the MetadataView read methods over gRPC, with a short-TTL holders cache.

Reads go to the replica that answered last (any replica serves reads; see ``endpoints.py``
for failover). ``holders``/``replicas``/``replica_count``/``replica_counts`` share one cache
of each key's holders, filled by ONE ``Holders`` RPC for all the keys a call misses, so
kvdb's eviction (replica counts of every candidate, once per round) costs at most one round
trip per round and nothing within ``cache_ttl_s`` of the previous round.

Staleness: a cached entry is at most ``cache_ttl_s`` old, plus the serving replica's lag
behind the leader (a follower applies committed entries within a Raft heartbeat, ~50 ms).
Writes made through the same :class:`RemoteMetadata` drop the keys they touch from the cache
(``replace_holdings`` and ``reap_dead_nodes`` drop it all), so a client reads its own writes
as long as it reads from the replica that served them (it does, unless that one failed).
The other reads (targets, nodes, counts per node, status) are never cached.

Thread-safe; every result is a new object the caller owns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvflow.replication.codec import check_key, check_keys, check_node
from kvflow.replication.endpoints import Endpoints
from kvflow.replication.types import NodeId, NodeInfo, Tier
from kvflow.replication.wire import holders_from, keys_from, keys_msg, node_info_from, pb2

MAX_CACHED_KEYS = 1 << 20
"""The cache is emptied when it would hold more keys than this (bounds its memory)."""


class RemoteMetadataView:
    """Read-only queries of the metadata group over gRPC (see the module docstring)."""

    def __init__(self, endpoints: Endpoints, cache_ttl_s: float) -> None:
        self._endpoints = endpoints
        self._ttl = cache_ttl_s
        self._lock = threading.Lock()
        self._cache: dict[bytes, tuple[float, dict[NodeId, Tier]]] = {}

    # ------------------------------------------------------------------ cached

    def holders(self, keys: Sequence[bytes]) -> list[dict[NodeId, Tier]]:
        """``replicas`` of each key, in order; keys missing from the cache (or expired) are
        read in one RPC, from one replica's consistent state."""
        keys = check_keys(keys, "keys")
        now = time.monotonic()
        found: dict[bytes, dict[NodeId, Tier]] = {}
        if self._ttl > 0:
            with self._lock:
                for key in keys:
                    entry = self._cache.get(key)
                    if entry is not None and entry[0] > now:
                        found[key] = entry[1]
        missing = list(dict.fromkeys(k for k in keys if k not in found))
        if missing:
            reply = self._read("Holders", pb2.KeysRequest(keys=keys_msg(missing)))
            fetched = holders_from(reply)
            found.update(zip(missing, fetched, strict=True))
            if self._ttl > 0:
                self._store(missing, fetched, now + self._ttl)
        return [dict(found[key]) for key in keys]

    def replicas(self, key: bytes) -> dict[NodeId, Tier]:
        """The nodes holding ``key`` and in which tier; empty if none."""
        return self.holders([check_key(key)])[0]

    def replica_count(self, key: bytes) -> int:
        """How many nodes hold ``key``."""
        return len(self.replicas(key))

    def replica_counts(self, keys: Sequence[bytes]) -> list[int]:
        """``replica_count`` of each key, in order (one RPC at most)."""
        return [len(h) for h in self.holders(keys)]

    def tier_of(self, key: bytes, node: NodeId) -> Tier | None:
        """The tier of ``node``'s replica of ``key``, or None if it holds none."""
        return self.replicas(key).get(node)

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drop ``keys`` from the cache (after a write that touched them)."""
        with self._lock:
            for key in keys:
                self._cache.pop(key, None)

    def forget_all(self) -> None:
        """Empty the cache."""
        with self._lock:
            self._cache.clear()

    # ------------------------------------------------------------------ uncached

    def replica_target(self, key: bytes) -> int:
        """The desired replica count of ``key`` (1 unless set)."""
        request = pb2.KeysRequest(keys=keys_msg([check_key(key)]))
        return int(self._read("ReplicaTargets", request).counts[0])

    def blocks_on(self, node: NodeId) -> int:
        """How many blocks ``node`` holds."""
        reply = self._read("NodeBlocks", pb2.NodeBlocksRequest(node=check_node(node)))
        return int(reply.num_blocks)

    def keys_on(self, node: NodeId) -> list[bytes]:
        """The keys ``node`` holds, sorted."""
        request = pb2.NodeBlocksRequest(node=check_node(node), include_keys=True)
        return keys_from(self._read("NodeBlocks", request).keys, "keys")

    def under_replicated(self, limit: int = 100) -> list[tuple[bytes, int, int]]:
        """Up to ``limit`` held keys below their replica target: ``(key, count, target)``."""
        reply = self._read("UnderReplicated", pb2.UnderReplicatedRequest(limit=limit))
        return [(bytes(e.key), int(e.count), int(e.target)) for e in reply.entries]

    def nodes(self) -> list[NodeInfo]:
        """Every known node, sorted by id."""
        return [node_info_from(msg) for msg in self._read("Nodes", pb2.NodesRequest()).nodes]

    def node_info(self, node: NodeId) -> NodeInfo | None:
        """The record of ``node``, or None if unknown."""
        return next((info for info in self.nodes() if info.node == node), None)

    def num_blocks(self) -> int:
        """How many distinct keys have at least one replica (on the serving replica)."""
        return int(self.status().num_blocks)

    def commands_applied(self) -> int:
        """How many commands the serving replica has applied."""
        return int(self.status().commands_applied)

    def is_leader(self) -> bool:
        """Whether the replica serving this view's reads believes it is the leader."""
        return bool(self.status().is_leader)

    def leader(self) -> str | None:
        """The leader's Raft address as the serving replica knows it, or None."""
        return self.status().leader or None

    def status(self) -> Any:
        """The serving replica's ``StatusReply`` (metadata.proto)."""
        reply = self._read("Status", pb2.StatusRequest())
        return reply

    # ------------------------------------------------------------------ internals

    def _read(self, method: str, request: Any) -> Any:
        return self._endpoints.call(method, request, write=False)

    def _store(self, keys: list[bytes], holders: list[dict[NodeId, Tier]], expiry: float) -> None:
        with self._lock:
            if len(self._cache) + len(keys) > MAX_CACHED_KEYS:
                self._cache.clear()
            for key, replicas in zip(keys, holders, strict=True):
                self._cache[key] = (expiry, replicas)
