"""The kvdb admin gRPC service (``kvflow.kvdb.v1.KVAdmin``): nodes, shards, tiers, replicas,
hot blocks, put/get statistics and manual eviction, over what a server holds.

A server describes what it holds with an ``AdminSource``: its shards by id (each a
``ShardRef``: the Shard, its node id, its kind) and, in a cluster, a read-only metadata view.
``add_admin_service(server, source)`` mounts ``KVAdmin`` on a grpc.Server or grpc.aio.Server;
``ADMIN_SERVICE_NAME`` is the name to list for server reflection.

Who calls: every RPC takes the caller's ``Viewer`` (viewer.py; ADMIN unless the server says
otherwise). A user sees only its tenant's blocks in Hot, Replicas and Stats and is refused the
cluster-wide RPCs (AccessDeniedError, PERMISSION_DENIED); the owner is each block's recorded
tenant. A server with no blocks of its own (a router: the metadata records holders, not
owners) gives its source ``peers`` (fanout.py): Hot, Replicas and Stats are then answered by
the nodes, asked at once with the caller's tenant as their filter, and merged.

Thread-safety: the servicer keeps no state of its own; every call reads the shards (each
thread-safe) and the metadata view (thread-safe) afresh. Bad input raises InvalidRequestError
(INVALID_ARGUMENT) or UnknownShardError (NOT_FOUND) before anything is changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import grpc

from kvflow.kvdb.admin_rows import shard_stats_row, tenant_stats_row, usage_row
from kvflow.kvdb.errors import InvalidRequestError, UnknownShardError
from kvflow.kvdb.fanout import AdminPeers, merge_hot, merge_replicas, merge_stats, total_of
from kvflow.kvdb.grpc_mount import Metadata, method_names, servicer_for
from kvflow.kvdb.keys import KEY_BYTES
from kvflow.kvdb.proto import ADMIN_SERVICE_NAME, pb2, pb2_grpc
from kvflow.kvdb.shard import Shard
from kvflow.kvdb.viewer import ADMIN, Viewer
from kvflow.replication import DEFAULT_REPLICA_TARGET, NodeId, NodeInfo, Tier

MAX_HOT = 10_000
"""The largest ``n`` a Hot request may ask for."""

DEFAULT_DEAD_AFTER_S = 10.0
"""A metadata node whose last heartbeat is older than this is shown unhealthy."""

TIER_NAMES: dict[str, Tier] = {"dram": Tier.DRAM, "ssd": Tier.SSD}


class ShardRef(NamedTuple):
    """One shard a server holds: the shard, the node it belongs to, the node's kind
    ("prefill", "decode", ...) and, optionally, the address shown for it."""

    shard: Shard
    node: NodeId
    kind: str
    address: str = ""


class MetadataReader(Protocol):
    """The parts of ``kvflow.replication.MetadataView`` the admin service reads."""

    def nodes(self) -> list[NodeInfo]: ...

    def replicas(self, key: bytes) -> dict[NodeId, Tier]: ...

    def replica_target(self, key: bytes) -> int: ...

    def num_blocks(self) -> int: ...


class AdminSource(Protocol):
    """What a server exposes to the admin service. ``shards`` may change between calls (it
    is read on every call); plain ``(shard, node, kind)`` tuples are accepted as values.
    ``peers``: the servers whose blocks Hot, Replicas and Stats also show (None: only the
    local shards)."""

    @property
    def shards(self) -> Mapping[str, ShardRef]: ...

    @property
    def metadata(self) -> MetadataReader | None: ...

    @property
    def peers(self) -> AdminPeers | None: ...


@dataclass(frozen=True)
class StaticAdminSource:
    """An AdminSource over a fixed mapping (the embedded server, a node, tests; a router
    with its nodes as ``peers``)."""

    shards: Mapping[str, ShardRef]
    metadata: MetadataReader | None = None
    peers: AdminPeers | None = None


def parse_key(text: str) -> bytes:
    """A block key from its 32-character hex form; InvalidRequestError otherwise."""
    cleaned = text.strip().lower()
    if len(cleaned) != 2 * KEY_BYTES:
        raise InvalidRequestError(
            f"key must be {2 * KEY_BYTES} hex characters (a {KEY_BYTES}-byte block key), "
            f"got {len(cleaned)} characters: {text!r:.80}"
        )
    try:
        return bytes.fromhex(cleaned)
    except ValueError:
        raise InvalidRequestError(f"key is not hexadecimal: {text!r:.80}") from None


def parse_tier(text: str) -> Tier:
    tier = TIER_NAMES.get(text.strip().lower())
    if tier is None:
        raise InvalidRequestError(f"tier must be one of {sorted(TIER_NAMES)}, got {text!r:.40}")
    return tier


class KVAdmin:
    """The logic of the KVAdmin RPCs: ``Name(request) -> response`` (protobuf messages).

    clock: wall-clock seconds (the clock the metadata group's heartbeats use); dead_after_s:
    a node whose last heartbeat is older is reported unhealthy.
    """

    def __init__(
        self,
        source: AdminSource,
        *,
        clock: Callable[[], float] = time.time,
        dead_after_s: float = DEFAULT_DEAD_AFTER_S,
    ) -> None:
        if dead_after_s <= 0:
            raise ValueError(f"dead_after_s must be > 0, got {dead_after_s}")
        self._source = source
        self._clock = clock
        self._dead_after_s = dead_after_s

    # ----------------------------------------------------------------- helpers

    def _shards(self, only: str = "") -> list[tuple[str, ShardRef]]:
        """(id, ref) of every shard, sorted by id, or just ``only``; UnknownShardError."""
        shards = {sid: ShardRef(*ref) for sid, ref in self._source.shards.items()}
        if only:
            if only not in shards:
                raise UnknownShardError(f"no shard {only!r} here; shards: {sorted(shards)}")
            return [(only, shards[only])]
        return sorted(shards.items())

    def _shards_here(self, only: str) -> list[tuple[str, ShardRef]]:
        """Like ``_shards``, but with peers a shard that is not local may be theirs."""
        if only and self._source.peers is not None and only not in self._source.shards:
            return []
        return self._shards(only)

    def _with_peers(
        self, rpc: str, request: Any, local: Any, merge: Callable[[list[Any]], Any]
    ) -> Any:
        """``local``, or, with peers, ``merge`` of it and the peers' answers to ``request``
        (the nodes that did not answer named in ``skipped_nodes``). UnknownShardError when a
        shard was asked for that neither this server nor any peer has."""
        peers = self._source.peers
        if peers is None:
            return local
        answers = peers.ask(rpc, request)
        shard = getattr(request, "shard", "")
        if shard and shard not in self._source.shards and not answers.replies:
            skipped = f" ({', '.join(answers.skipped)} did not answer)" if answers.skipped else ""
            raise UnknownShardError(f"no shard {shard!r} here or on the nodes{skipped}")
        merged = merge([local, *answers.replies])
        merged.skipped_nodes.extend(answers.skipped)
        return merged

    # ----------------------------------------------------------------- RPCs

    def Nodes(self, request: Any, viewer: Viewer = ADMIN) -> Any:
        viewer.require_admin("Nodes")
        meta = self._source.metadata
        if meta is None:
            rows = []
            for sid, ref in self._shards():
                rows.append(
                    pb2.Node(
                        node=ref.node,
                        kind=ref.kind,
                        address=ref.address,
                        healthy=not ref.shard.closed,
                        blocks=len(ref.shard.holdings()),
                        source="local",
                        shard=sid,
                    )
                )
            return pb2.NodesResponse(nodes=rows, total_blocks=sum(r.blocks for r in rows))
        now = self._clock()
        rows = [
            pb2.Node(
                node=info.node,
                kind=info.kind,
                address=info.address,
                healthy=now - info.last_heartbeat <= self._dead_after_s,
                blocks=info.num_blocks,
                has_heartbeat=True,
                last_heartbeat=info.last_heartbeat,
                heartbeat_age_s=max(0.0, now - info.last_heartbeat),
                source="metadata",
            )
            for info in meta.nodes()
        ]
        return pb2.NodesResponse(nodes=rows, total_blocks=meta.num_blocks())

    def Shards(self, request: Any, viewer: Viewer = ADMIN) -> Any:
        viewer.require_admin("Shards")
        rows = []
        for sid, ref in self._shards():
            shard = ref.shard
            s = shard.stats()
            rows.append(
                pb2.ShardInfo(
                    shard=sid,
                    node=ref.node,
                    kind=ref.kind,
                    engine=shard.config.engine,
                    eviction=shard.config.eviction,
                    compression=shard.config.compression,
                    dram=usage_row(s.dram),
                    ssd=usage_row(s.ssd),
                    pinned_blocks=shard.num_pinned(),
                    closed=shard.closed,
                )
            )
        return pb2.ShardsResponse(shards=rows)

    def Tiers(self, request: Any, viewer: Viewer = ADMIN) -> Any:
        viewer.require_admin("Tiers")
        rows = []
        for sid, ref in self._shards(request.shard):
            s = ref.shard.stats()
            for name, t in (("dram", s.dram), ("ssd", s.ssd)):
                rows.append(
                    pb2.TierCounters(
                        shard=sid,
                        node=ref.node,
                        tier=name,
                        hits=t.hits,
                        misses=t.misses,
                        hit_rate=t.hit_rate,
                        bytes_read=t.bytes_read,
                        bytes_written=t.bytes_written,
                        evictions=t.evictions,
                        demotions=t.demotions,
                        promotions=t.promotions,
                        corruptions=t.corruptions,
                        blocks=t.blocks,
                        used_bytes=t.used_bytes,
                        capacity_bytes=t.capacity_bytes,
                    )
                )
        return pb2.TiersResponse(tiers=rows)

    def Replicas(self, request: Any, viewer: Viewer = ADMIN) -> Any:
        key = parse_key(request.key)
        tenant = viewer.scope(request.tenant)
        local = self._local_replicas(key, tenant)
        down = pb2.ReplicasRequest(key=key.hex(), tenant=tenant or "")
        return self._with_peers("Replicas", down, local, lambda r: merge_replicas(key.hex(), r))

    def _local_replicas(self, key: bytes, tenant: str | None) -> Any:
        """Who holds ``key`` per the metadata and the local shards; with ``tenant``, only if
        a local shard holds it as that tenant's block."""
        rows = []
        meta = self._source.metadata
        target = 0
        if tenant is not None and not self._owns(tenant, key):
            # the answer for a key nobody holds: another tenant's key is not even confirmed
            return pb2.ReplicasResponse(
                key=key.hex(),
                replica_target=0 if meta is None else DEFAULT_REPLICA_TARGET,
                has_metadata=meta is not None,
            )
        if meta is not None:
            target = meta.replica_target(key)
            for node, tier in sorted(meta.replicas(key).items()):
                rows.append(pb2.Replica(node=node, tier=tier.name.lower(), source="metadata"))
        for sid, ref in self._shards():
            tier = ref.shard.tier_of(key)
            if tier is not None:
                rows.append(
                    pb2.Replica(node=ref.node, tier=tier.name.lower(), source="local", shard=sid)
                )
        return pb2.ReplicasResponse(
            key=key.hex(), replicas=rows, replica_target=target, has_metadata=meta is not None
        )

    def Hot(self, request: Any, viewer: Viewer = ADMIN) -> Any:
        n = request.n
        if not 1 <= n <= MAX_HOT:
            raise InvalidRequestError(f"n must be in [1, {MAX_HOT}], got {n}")
        tenant = viewer.scope(request.tenant)
        rows = []
        for sid, ref in self._shards_here(request.shard):
            for b in ref.shard.hot(n, tenant):
                rows.append(
                    pb2.HotBlock(
                        key=b.key.hex(),
                        hits=b.hits,
                        tier=b.tier.name.lower(),
                        shard=sid,
                        node=ref.node,
                        nbytes=b.nbytes,
                        pins=b.pins,
                        tenant=b.tenant,
                    )
                )
        local = merge_hot([pb2.HotResponse(blocks=rows)], n)
        down = pb2.HotRequest(n=n, shard=request.shard, tenant=tenant or "")
        return self._with_peers("Hot", down, local, lambda replies: merge_hot(replies, n))

    def Stats(self, request: Any, viewer: Viewer = ADMIN) -> Any:
        tenant = viewer.scope(request.tenant)
        if request.reset:
            viewer.require_admin("Stats with reset")
        local = self._local_stats(request.shard, request.reset, tenant, viewer.admin)
        down = pb2.StatsRequest(shard=request.shard, reset=request.reset, tenant=tenant or "")
        merged = self._with_peers("Stats", down, local, merge_stats)
        if not viewer.admin:  # the peers answered an admin (the cluster token): drop the rest
            del merged.shards[:]
            merged.total.CopyFrom(pb2.ShardStats(shard="total"))
        return merged

    def _local_stats(self, only: str, reset: bool, tenant: str | None, admin: bool) -> Any:
        shards = self._shards_here(only)
        tenants = []
        if tenant is not None:
            tenants = [
                tenant_stats_row(sid, ref.node, ref.shard.tenant_usage(tenant))
                for sid, ref in shards
            ]
        if not admin:  # shard-wide counters (puts, misses...) have no owner
            return pb2.StatsResponse(total=pb2.ShardStats(shard="total"), tenants=tenants)
        rows = [shard_stats_row(sid, ref.node, ref.shard.stats(reset=reset)) for sid, ref in shards]
        return pb2.StatsResponse(shards=rows, total=total_of(rows), tenants=tenants)

    def Evict(self, request: Any, viewer: Viewer = ADMIN) -> Any:
        viewer.require_admin("Evict")
        if not request.shard:
            raise InvalidRequestError("shard is required (see the Shards RPC for the ids)")
        tier = parse_tier(request.tier)
        if request.bytes < 0:
            raise InvalidRequestError(f"bytes must be >= 0, got {request.bytes}")
        [(_, ref)] = self._shards(request.shard)
        before = ref.shard.stats()
        evicted = ref.shard.evict(tier, request.bytes)
        after = ref.shard.stats()
        pick = (lambda s: s.dram) if tier is Tier.DRAM else (lambda s: s.ssd)
        return pb2.EvictResponse(
            blocks_evicted=evicted, before=usage_row(pick(before)), after=usage_row(pick(after))
        )

    def _owns(self, tenant: str | None, key: bytes) -> bool:
        """Whether a local shard holds ``key`` as a block of ``tenant``."""
        for _, ref in self._shards():
            info = ref.shard.info(key)
            if info is not None and info.tenant == tenant:
                return True
        return False


def add_admin_service(
    server: grpc.Server | grpc.aio.Server,
    source: AdminSource,
    *,
    clock: Callable[[], float] = time.time,
    dead_after_s: float = DEFAULT_DEAD_AFTER_S,
    viewer_of: Callable[[Metadata], Viewer] | None = None,
) -> KVAdmin:
    """Register the KVAdmin service for ``source`` on ``server`` (before it starts) and return
    its logic object. Add ``ADMIN_SERVICE_NAME`` to the server's reflection names.
    ``viewer_of``: the caller of each call from its metadata (None: every caller is ADMIN)."""
    core = KVAdmin(source, clock=clock, dead_after_s=dead_after_s)
    descriptor = pb2.DESCRIPTOR.services_by_name["KVAdmin"]
    caller = viewer_of or (lambda _metadata: ADMIN)
    servicer = servicer_for(
        server, core, pb2_grpc.KVAdminServicer, method_names(descriptor), caller
    )
    pb2_grpc.add_KVAdminServicer_to_server(servicer, server)
    return core


__all__ = [
    "ADMIN_SERVICE_NAME",
    "AdminSource",
    "KVAdmin",
    "MetadataReader",
    "ShardRef",
    "StaticAdminSource",
    "Viewer",
    "add_admin_service",
    "parse_key",
    "parse_tier",
]
