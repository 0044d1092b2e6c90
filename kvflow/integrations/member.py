"""ClusterMember: another engine's process as a member of a kvflow cluster.

With metadata addresses, the member holds a kvdb shard registered in the Raft metadata (its
blocks are recorded there, follow replica targets and eviction like any node's), serves them
to peers (gRPC BlockService + admin service, a transfer-engine tcp server exposing its DRAM
pool) and reads the blocks it lacks from live peers over the transfer engine. Without them it
is an embedded store: one shard in this process, no servers, no peers.

Keys are final ``BlockKey`` bytes (the caller derives them inside its namespace). Every method
is thread-safe. Misses are return values; a dead peer is a miss, never an exception. What a
miss means to the caller (``Misses``, chosen when the member is made) decides how hard a read
tries a holder that did not answer in time before it reports one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from enum import Enum
from typing import Any

import grpc
import numpy as np

from kvflow.integrations.config import MemberConfig
from kvflow.integrations.fetched import MISS, Fetched
from kvflow.integrations.peers import PeerRead, Peers, format_member_address
from kvflow.kvdb import (
    BlockPinnedError,
    BlockToCopy,
    Namespace,
    NotEnoughReplicasError,
    ReplicaWriter,
    ShardRef,
    StaticAdminSource,
    StoreConfig,
    StoreFullError,
    Tier,
    ValueSizeError,
    add_admin_service,
    add_block_service,
    open_store,
)
from kvflow.replication import NodeId, RemoteMetadata
from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_interceptors
from kvflow.security.tls import add_port
from kvflow.transfer import TransferConfig, TransferEngine

logger = logging.getLogger(__name__)

MEMBER_KIND = "store"  # the metadata's node kind: routers never schedule requests on it
CLIENT_KIND = "store-client"  # a member that holds nothing (takes no copies)
MESSAGE_BYTES = 96 << 20  # a pushed copy carries up to one 64 MiB value
METADATA_READY_S = 30.0


class Misses(Enum):
    """What a miss means to the member's caller: the one place that decides how hard a read
    tries before it reports one (docs/durability.md, "A holder that is slow, not dead").

    RECOMPUTE: a miss costs a recompute (a serving engine's prefix reuse): a holder that does
        not answer within its deadline (``PeerCallBudget.base_s`` plus its bytes) is skipped
        and, with no other replica, the key is a miss at once.
    ANSWER: a miss is an answer the client acts on (a Mooncake store's ``get``: b"" means the
        object is gone): when a key is still missing after every live holder was tried and
        some of them did not answer (timed out, or skipped for an open breaker; not refused),
        those are tried once more, one after another, with the budget's ``last_resort_s``
        and whatever their breakers say. A holder whose last-resort try timed out too gets no
        other one until it answers or has been silent for ``peer_dead_after_s``.
    """

    RECOMPUTE = "recompute"
    ANSWER = "answer"


# one read of keys[idx] from a peer, with a patience (0 = the normal deadline), writing the
# outcomes into the caller's results; returns whether the peer left them unanswered
_PeerReadFn = Callable[[NodeId, list[int], float], bool]


@dataclass
class MemberCounters:
    """Blocks served per source since the last reset (read with ``counters(reset)``)."""

    dram_hits: int = 0
    ssd_hits: int = 0
    remote_hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected_puts: int = 0


class ClusterMember:
    """One member (see the module doc). ``namespace`` binds the shard to one model and layout
    (another model's data dir raises NamespaceMismatchError-like IncompatibleDataDirError);
    ``value_size``: the exact size of every value, None = any size up to 64 MiB. ``misses``:
    what a miss means to the caller (``Misses``)."""

    def __init__(
        self,
        config: MemberConfig,
        namespace: Namespace,
        value_size: int | None = None,
        clock: Callable[[], float] = time.time,
        misses: Misses = Misses.RECOMPUTE,
    ) -> None:
        if not isinstance(misses, Misses):
            raise ValueError(f"misses: must be a Misses, got {misses!r}")
        self.config = config
        self.misses = misses
        self.namespace = namespace
        self.node = NodeId(config.node_id)
        self._clock = clock
        self._lock = threading.Lock()
        self._counters = MemberCounters()
        self._stop = threading.Event()
        self._closers: list[Callable[[], None]] = []
        self.metadata: RemoteMetadata | None = None
        self.peers: Peers | None = None
        self.writer: ReplicaWriter | None = None
        self.kind = CLIENT_KIND if config.holds_nothing else MEMBER_KIND
        self.address = ""
        try:
            self._open(value_size)
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- lifecycle

    def _store_config(self, value_size: int | None) -> StoreConfig:
        c = self.config
        return StoreConfig(
            data_dir=c.shard_dir,
            dram_capacity_bytes=c.dram_bytes,
            ssd_capacity_bytes=c.ssd_bytes,
            engine=c.store_engine,
            value_size=value_size,
            dram_prefault=c.dram_prefault,
            verify_dram_hits=c.verify_dram_hits,
        )

    def _open(self, value_size: int | None) -> None:
        c = self.config
        store_config = self._store_config(value_size)
        if not c.clustered:
            self.store = open_store(store_config, self.namespace, node_id=self.node)
            self._closers.append(self.store.close)
            return
        metadata = RemoteMetadata(list(c.meta))
        self.metadata = metadata
        self._closers.append(metadata.close)
        metadata.start()
        metadata.wait_ready(METADATA_READY_S)
        self.transfer = TransferEngine(TransferConfig(prefer_shm=c.same_host_shm))
        self._closers.append(self.transfer.close)
        host, tport = self.transfer.start_server(c.host, c.transfer_port)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvflow-member"),
            options=[("grpc.max_receive_message_length", MESSAGE_BYTES), ("grpc.so_reuseport", 0)],
            interceptors=cluster_interceptors(process_secret()),
        )
        port = add_port(self.server, f"{c.host}:{c.port}", None)  # TLS when configured
        if port == 0:
            raise OSError(f"port: cannot listen on {c.host}:{c.port}")
        self.address = format_member_address(f"{c.host}:{port}", f"{host}:{tport}")
        # Registered with its address before the store opens: re-adoption writes would
        # otherwise register the node implicitly, without an address peers can use.
        metadata.register_node(self.node, self.address, self.kind)
        self.store = open_store(store_config, self.namespace, node_id=self.node, metadata=metadata)
        self._closers.append(self.store.close)
        source = StaticAdminSource(
            {c.node_id: ShardRef(self.store.shard, self.node, self.kind)}, metadata.view()
        )
        add_admin_service(self.server, source)
        record = None if c.holds_nothing else self.store.flush_metadata
        blocks = add_block_service(self.server, source, self.transfer, record=record)
        self._closers.append(blocks.close)
        self.writer = ReplicaWriter(
            self.node,
            metadata,
            self.store.flush_metadata,
            kinds=frozenset({MEMBER_KIND}),
            dead_after_s=c.peer_dead_after_s,
            clock=self._clock,
        )
        self.store.replica_writer = self.writer
        self._closers.append(self.writer.close)
        self.server.start()
        self._closers.append(lambda: self.server.stop(1.0).wait(5.0))
        self.peers = Peers(c.node_id, metadata, self.transfer, c.peer_dead_after_s, self._clock)
        self._closers.append(self.peers.close)
        beat = threading.Thread(target=self._heartbeats, name="kvflow-member-hb", daemon=True)
        beat.start()
        self._closers.append(lambda: beat.join(5.0))
        self._closers.append(self._stop.set)
        logger.info("member=%s joined the cluster at %s", self.node, self.address)

    def _heartbeats(self) -> None:
        assert self.metadata is not None
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                if not self.metadata.heartbeat(self.node):
                    # dropped (or a new metadata group): register again and re-adopt
                    self.metadata.register_node(self.node, self.address, self.kind)
                    self.metadata.replace_holdings(self.node, self.store.shard.holdings())
            except Exception:
                logger.warning("member=%s heartbeat failed", self.node, exc_info=True)

    def close(self) -> None:
        """Stop serving, leave (the metadata drops the member after its dead time), close the
        shard (DRAM flushed to SSD per the store config). Idempotent."""
        self._stop.set()
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception:
                logger.warning("member=%s close step failed", self.node, exc_info=True)

    def __enter__(self) -> ClusterMember:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- blocks

    def register_destination(self, buffer: Any) -> None:
        """Remote reads into views of ``buffer`` land there directly (no staging copy)."""
        if self.peers is not None:
            self.peers.register_destination(buffer)

    def put(self, key: bytes, value: Any, parent: bytes | None = None, replicas: int = 1) -> bool:
        """Store ``value`` (copied) in this member's shard, owned by the tenant of its
        namespace; True if it is held (already or now), False if no tier had room. Raises
        ValueSizeError / InvalidBufferError.

        ``replicas`` > 1 (or a member that holds nothing): True only once that many distinct
        members hold the value and the metadata records them — this member's copy plus
        copies pushed to peers (``kvdb.ReplicaWriter``, docs/durability.md). Raises
        NotEnoughReplicasError when too few live members exist or took a copy."""
        shard = self.store.shard
        had = replicas > 1 and shard.exists(key)
        try:
            tier = shard.put(key, value, parent, self.namespace.tenant)
        except StoreFullError:
            tier = None
        if replicas > 1 or (tier is None and self.config.holds_nothing):
            try:
                if self.writer is None:
                    raise NotEnoughReplicasError(
                        f"replicas={replicas}: an embedded store has no peers to copy to"
                    )
                block = BlockToCopy(key, value, parent, self.namespace.tenant)
                self.writer.write([block], replicas, tier is not None)
            except NotEnoughReplicasError:
                if tier is not None and not had:  # not acknowledged: take our copy back
                    self.remove([key])
                raise
            tier = tier or Tier.DRAM  # held by the peers
        with self._lock:
            self._counters.puts += 1
            self._counters.rejected_puts += tier is None
        return tier is not None

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: held here or by a live peer (per the metadata). No recency update."""
        shard = self.store.shard
        out = [shard.exists(k) for k in keys]
        missing = [i for i, hit in enumerate(out) if not hit]
        if missing and self.peers is not None:
            for i, holder in zip(
                missing, self.peers.holders([keys[i] for i in missing]), strict=True
            ):
                out[i] = holder is not None
        return out

    def read_into(self, keys: Sequence[bytes], bufs: Sequence[Any]) -> list[str | None]:
        """Fill ``bufs[i]`` (each exactly its value's size) with ``keys[i]``'s value: from
        this shard, else from a live peer that holds it. Per key its source ("dram", "ssd",
        "remote") or None (a miss; that buffer then holds unspecified bytes)."""
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        shard = self.store.shard
        out: list[str | None] = []
        for key, buf in zip(keys, bufs, strict=True):
            tier = shard.get_into(key, buf)
            out.append(None if tier is None else ("dram" if tier is Tier.DRAM else "ssd"))
        missing = [i for i, src in enumerate(out) if src is None]

        def read(node: NodeId, idx: list[int], patience_s: float) -> bool:
            got = self.peers.read_into(  # type: ignore[union-attr]
                node, [keys[i] for i in idx], [bufs[i] for i in idx], patience_s
            )
            for i, ok in zip(idx, got.got, strict=True):
                out[i] = "remote" if ok else None
            return got.unanswered

        self._from_peers(keys, missing, lambda i: out[i] is None, read)
        self._count(out)
        return out

    def read_fitting(
        self, keys: Sequence[bytes], bufs: Sequence[np.ndarray], sizes: Sequence[int | None]
    ) -> list[Fetched]:
        """Like ``read_into``, but a buffer (flat uint8 numpy array) may be larger than its
        value, which then fills its head. ``sizes[i]``: the value's size if the caller knows
        it (a hint, checked; None = unknown: the value is first read whole, one more copy).
        The keys this shard lacks are read from live peers, one lease per peer and run of
        keys. Per key a ``Fetched``: where it came from and its size, a miss, or too small."""
        if not len(keys) == len(bufs) == len(sizes):
            raise ValueError(f"{len(keys)} keys, {len(bufs)} buffers, {len(sizes)} sizes")
        shard = self.store.shard
        out = self._read_locals(shard, keys, bufs, sizes)
        missing = [i for i, f in enumerate(out) if f == MISS]

        def read(node: NodeId, idx: list[int], patience_s: float) -> bool:
            got = self.peers.read_fitting(  # type: ignore[union-attr]
                node, [keys[i] for i in idx], [bufs[i] for i in idx], patience_s
            )
            for i, fetched in zip(idx, got.got, strict=True):
                out[i] = fetched
            return got.unanswered

        self._from_peers(keys, missing, lambda i: out[i] == MISS, read)
        self._count([f.source for f in out if not f.too_small])
        return out

    def _from_peers(
        self,
        keys: Sequence[bytes],
        missing: list[int],
        still_missing: Callable[[int], bool],
        read: _PeerReadFn,
    ) -> None:
        """Read the ``missing`` keys from their live holders with ``read`` (``_by_holder``
        rounds); then, per ``self.misses``, give the holders that left a key still missing
        unanswered their last-resort try (``Misses.ANSWER``)."""
        if not missing or self.peers is None:
            return
        rows = self.peers.holder_lists([keys[i] for i in missing])
        silent = self._by_holder(dict(zip(missing, rows, strict=True)), still_missing, read, 0.0)
        if self.misses is Misses.ANSWER:
            again = {i: nodes for i, nodes in silent.items() if still_missing(i)}
            if again:
                logger.info(
                    "member=%s %d keys missing after every holder; %d holders did not answer: "
                    "trying them once more with %.1fs",
                    self.node, len(again), len({n for r in again.values() for n in r}),
                    self.peers.last_resort_s,
                )  # fmt: skip
                self._by_holder(again, still_missing, read, self.peers.last_resort_s)

    @staticmethod
    def _by_holder(
        pending: dict[int, list[NodeId]],
        still_missing: Callable[[int], bool],
        read: _PeerReadFn,
        patience_s: float,
    ) -> dict[int, list[NodeId]]:
        """Read in rounds the keys of ``pending`` (position in the caller's keys -> its
        holders, in order): first each key's first holder (one read per peer), then, for the
        keys ``still_missing`` after that read, their next holder, and so on — a holder that
        died is skipped over. Per key, the holders that left it unanswered."""
        silent: dict[int, list[NodeId]] = {}
        while pending:
            by_node: dict[NodeId, list[int]] = {}
            for i, row in pending.items():
                if row:
                    by_node.setdefault(row[0], []).append(i)
            for node, idx in by_node.items():
                if read(node, idx, patience_s):
                    for i in idx:
                        silent.setdefault(i, []).append(node)
            pending = {i: r[1:] for i, r in pending.items() if len(r) > 1 and still_missing(i)}
        return silent

    @classmethod
    def _read_locals(
        cls,
        shard: Any,
        keys: Sequence[bytes],
        bufs: Sequence[np.ndarray],
        sizes: Sequence[int | None],
    ) -> list[Fetched]:
        """This shard's values of ``keys`` in one batch read (``Shard.get_many_into``): the keys
        without a size hint are sized first (``Shard.value_sizes``, one lock for all; one not
        held is a miss there); a value larger than its buffer is reported too small; a stale
        hint is read one by one."""
        unknown = [i for i, n in enumerate(sizes) if not n]
        sized = list(sizes)
        for i, n in zip(unknown, shard.value_sizes([keys[i] for i in unknown]), strict=True):
            sized[i] = n
        out: list[Fetched | None] = [None] * len(keys)
        batch: list[int] = []
        for i, n in enumerate(sized):
            if n is None:  # not held (sized: counted as a miss), or a hint for a key not held
                if not sizes[i]:
                    out[i] = MISS
                else:
                    batch.append(i)
            elif n > len(bufs[i]):
                out[i] = Fetched(None, n) if not sizes[i] else None
            else:
                batch.append(i)
        got = shard.get_many_into(
            [keys[i] for i in batch], [bufs[i][: sized[i] or len(bufs[i])] for i in batch]
        )
        for i, tier in zip(batch, got, strict=True):
            if isinstance(tier, Tier):
                out[i] = Fetched("dram" if tier is Tier.DRAM else "ssd", sized[i] or len(bufs[i]))
            elif tier is None:
                out[i] = MISS
        return [
            f if f is not None else cls._read_local(shard, keys[i], bufs[i], sizes[i])
            for i, f in enumerate(out)
        ]

    @staticmethod
    def _read_local(shard: Any, key: bytes, buf: np.ndarray, size: int | None) -> Fetched:
        if size is not None and size <= buf.shape[0]:
            try:
                tier = shard.get_into(key, buf[:size])
            except ValueSizeError:  # a stale hint: learn the size below
                pass
            else:
                if tier is None:
                    return MISS
                return Fetched("dram" if tier is Tier.DRAM else "ssd", size)
        value = shard.get(key)
        if value is None:
            return MISS
        if len(value) > buf.shape[0]:
            return Fetched(None, len(value))
        buf[: len(value)] = np.frombuffer(value, dtype=np.uint8)
        return Fetched("dram", len(value))

    def _count(self, sources: Sequence[str | None]) -> None:
        with self._lock:
            c = self._counters
            c.dram_hits += sources.count("dram")
            c.ssd_hits += sources.count("ssd")
            c.remote_hits += sources.count("remote")
            c.misses += sources.count(None)

    def size_of(self, key: bytes) -> int | None:
        """The size of ``key``'s value here or on a live peer, or None if nobody holds it."""
        value = self.store.shard.get(key)
        if value is not None:
            return len(value)
        size: list[int | None] = [None]

        def read(node: NodeId, idx: list[int], patience_s: float) -> bool:
            got: PeerRead[int | None] = self.peers.size_of(node, key, patience_s)  # type: ignore[union-attr]
            size[0] = got.got
            return got.unanswered

        self._from_peers([key], [0], lambda _: size[0] is None, read)
        return size[0]

    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove ``keys`` from this member's shard (peers keep their copies); the number
        removed. Pinned blocks (being read by a peer) stay."""
        removed = 0
        for key in keys:
            try:
                removed += self.store.shard.remove(key)
            except BlockPinnedError:
                logger.info("member=%s key=%s is pinned; not removed", self.node, key.hex())
        return removed

    def remove_all(self) -> int:
        """Remove every block this member's shard holds (every tenant of its model)."""
        return self.remove([key for key, _ in self.store.shard.holdings()])

    def counters(self, reset: bool = False) -> MemberCounters:
        with self._lock:
            snapshot = MemberCounters(**vars(self._counters))
            if reset:
                self._counters = MemberCounters()
        return snapshot


__all__ = ["MEMBER_KIND", "ClusterMember", "MemberCounters", "Misses"]
