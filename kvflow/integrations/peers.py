"""Peers: the other live members of a kvflow cluster and readers of their blocks.

A member registers in the metadata as ``<gRPC host:port>|<transfer host:port>`` (the format
kvflow's own nodes use), so SGLang processes, Mooncake-API processes and kvflow prefill nodes
read each other's blocks alike. Reads go through kvdb's ``RemoteClient`` (Lease over gRPC, a
transfer-engine READ straight into a registered destination, xxh3 check, Release).

Thread-safe. A peer that cannot be reached, a failed transfer or a failed checksum is a miss:
``read_into`` never raises for them. Each read also says whether the peer *answered*
(``PeerRead.unanswered``: its Lease timed out, or its breaker skipped it): a caller for which a
miss is an answer may then try it once more with ``last_resort_s`` (``patience_s``). A peer
whose last-resort try timed out too is not given another one until it answers a read or has
been silent for ``dead_after_s``: a peer paused for good costs one last-resort deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import grpc

from kvflow.integrations.fetched import MISS, Fetched
from kvflow.kvdb import KVDBError, RemoteClient, RemoteClientConfig, RemoteReadError
from kvflow.replication import NodeId, ReplicationError, Tier
from kvflow.transfer import TransferEngine, TransferError

logger = logging.getLogger(__name__)

NODES_TTL_S = 0.5

T = TypeVar("T")


class PeerRead(NamedTuple, Generic[T]):
    """One read from a peer: ``got``, its outcome (misses included), and ``unanswered``: the
    peer did not answer in time (its Lease timed out, or its open breaker skipped it), so a
    more patient try may still find what it missed."""

    got: T
    unanswered: bool


def format_member_address(control: str, transfer: str) -> str:
    return f"{control}|{transfer}"


def parse_member_address(address: str) -> tuple[str, str] | None:
    """(control, transfer) of a registered address, or None for another format."""
    control, sep, transfer = address.partition("|")
    return (control, transfer) if sep and control and transfer else None


class Peers:
    """Live peers of ``self_id`` per ``metadata`` (a RemoteMetadata), refreshed at most every
    ``NODES_TTL_S``; one RemoteClient per peer, every registered destination registered with
    it. ``clock`` is wall time, the clock heartbeats are recorded with."""

    def __init__(
        self,
        self_id: str,
        metadata: Any,
        transfer: TransferEngine,
        dead_after_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._self = NodeId(self_id)
        self._metadata = metadata
        self._transfer = transfer
        self._dead_after_s = dead_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[NodeId, tuple[str, str]] = {}
        self._loaded = -NODES_TTL_S
        self._failed: dict[NodeId, float] = {}  # peer -> monotonic time its last read failed
        self._hung: dict[NodeId, float] = {}  # peer -> when its last-resort try timed out
        self._client_config = RemoteClientConfig()
        self.last_resort_s = self._client_config.budget.last_resort_s
        self._clients: dict[NodeId, tuple[tuple[str, str], RemoteClient]] = {}
        self._destinations: list[Any] = []

    def register_destination(self, buffer: Any) -> None:
        """Read straight into views of ``buffer`` (kept alive by the caller until close)."""
        with self._lock:
            self._destinations.append(buffer)
            clients = [c for _, c in self._clients.values()]
        for client in clients:
            client.register_destination(buffer)

    def live(self) -> dict[NodeId, tuple[str, str]]:
        """{peer: (control, transfer)} of peers with a recent heartbeat (cached)."""
        with self._lock:
            if time.monotonic() - self._loaded < NODES_TTL_S:
                return self._live
        try:
            infos = self._metadata.view().nodes()
        except (ReplicationError, grpc.RpcError) as exc:
            logger.warning("member=%s cannot list peers: %s", self._self, exc)
            infos = []
        now = self._clock()
        live: dict[NodeId, tuple[str, str]] = {}
        for info in infos:
            addresses = parse_member_address(info.address)
            if info.node == self._self or addresses is None:
                continue
            if now - info.last_heartbeat <= self._dead_after_s:
                live[info.node] = addresses
        with self._lock:
            self._live, self._loaded = live, time.monotonic()
        return live

    def holders(self, keys: Sequence[bytes]) -> list[NodeId | None]:
        """For each key a live peer that holds it (per the metadata, which may lag by the
        view's cache TTL), or None."""
        return [row[0] if row else None for row in self.holder_lists(keys)]

    def holder_lists(self, keys: Sequence[bytes]) -> list[list[NodeId]]:
        """For each key every live peer that holds it, DRAM copies first and peers whose
        last read failed recently last: a reader tries them in turn (a peer that died within
        ``dead_after_s`` still looks live)."""
        if not keys:
            return []
        live = self.live()
        if not live:
            return [[] for _ in keys]
        try:
            rows = self._metadata.view().holders(keys)
        except (ReplicationError, grpc.RpcError) as exc:
            logger.warning("member=%s holders lookup failed: %s", self._self, exc)
            return [[] for _ in keys]
        now = time.monotonic()
        with self._lock:
            suspect = {n for n, t in self._failed.items() if now - t < self._dead_after_s}

        def order(n: NodeId, row: Any) -> tuple[bool, bool, str]:
            return (n in suspect, row[n] is not Tier.DRAM, n)

        return [
            sorted((n for n in row if n in live), key=lambda n, r=row: order(n, r)) for row in rows
        ]

    def _suspect(self, node: NodeId) -> None:
        """A read from ``node`` failed: re-read liveness before the next read, and try its
        copies last until it has been dead long enough to drop out of ``live``."""
        now = time.monotonic()
        with self._lock:
            self._loaded = -NODES_TTL_S
            self._failed = {n: t for n, t in self._failed.items() if now - t < self._dead_after_s}
            self._failed[node] = now

    def _client(self, node: NodeId) -> RemoteClient | None:
        addresses = self.live().get(node)
        if addresses is None:
            return None
        with self._lock:
            old = self._clients.get(node)
            if old is not None and old[0] == addresses:
                return old[1]
            stale = old[1] if old is not None else None
            client = RemoteClient(
                addresses[0], self._transfer, addresses[1], shard=node, config=self._client_config
            )
            for buffer in self._destinations:
                client.register_destination(buffer)
            self._clients[node] = (addresses, client)
        if stale is not None:
            stale.close()
        return client

    def _gave_up_on(self, node: NodeId, patience_s: float) -> bool:
        """A last-resort try (``patience_s`` > 0) to a peer whose last one timed out too,
        within ``dead_after_s`` of that: not worth another deadline."""
        if not patience_s:
            return False
        with self._lock:
            since = self._hung.get(node)
        return since is not None and time.monotonic() - since < self._dead_after_s

    def _answered(self, node: NodeId) -> None:
        with self._lock:
            self._hung.pop(node, None)

    def _failed_read(self, node: NodeId, exc: Exception, patience_s: float) -> bool:
        """Log and record a failed read of ``node``; whether it went unanswered."""
        unanswered = isinstance(exc, RemoteReadError) and (exc.timed_out or exc.skipped)
        logger.warning("member=%s read from peer=%s failed: %s", self._self, node, exc)
        self._suspect(node)
        if patience_s and unanswered:
            logger.warning(
                "member=%s peer=%s did not answer a last-resort read within %.1fs",
                self._self, node, patience_s,
            )  # fmt: skip
            with self._lock:
                self._hung[node] = time.monotonic()
        return unanswered

    def read_into(
        self, node: NodeId, keys: Sequence[bytes], bufs: Sequence[Any], patience_s: float = 0.0
    ) -> PeerRead[list[bool]]:
        """Read ``keys`` from ``node`` into ``bufs``; per key whether its bytes arrived and
        verified. Misses for anything that fails (the peer died, the lease or transfer
        failed, a checksum did not match); buffers of misses hold unspecified bytes.
        ``patience_s`` > 0: a last-resort try (module doc)."""
        client = self._client(node)
        if client is None or not keys or self._gave_up_on(node, patience_s):
            return PeerRead([False] * len(keys), False)
        try:
            got = client.batch_get_into(keys, bufs, patience_s)
        except (KVDBError, TransferError, OSError, grpc.RpcError) as exc:
            return PeerRead([False] * len(keys), self._failed_read(node, exc, patience_s))
        self._answered(node)
        return PeerRead([t is not None for t in got], False)

    def read_fitting(
        self, node: NodeId, keys: Sequence[bytes], bufs: Sequence[Any], patience_s: float = 0.0
    ) -> PeerRead[list[Fetched]]:
        """Read ``keys`` from ``node`` into the heads of ``bufs`` (flat uint8 numpy arrays, each
        at least its value's size) with one Lease RPC per run of held keys (the lease says
        each value's size), one transfer batch and an asynchronous Release. A miss for what
        is not held, fails its transfer or checksum, or an unreachable peer; ``too_small``
        (nothing read) for a buffer smaller than its value. ``patience_s`` > 0: a last-resort
        try (module doc)."""
        client = self._client(node)
        out = [MISS] * len(keys)
        if client is None or not keys or self._gave_up_on(node, patience_s):
            return PeerRead(out, False)
        try:
            pos = 0
            while pos < len(keys):
                lease = client.lease(keys[pos:], patience_s=patience_s)
                if not lease.blocks:
                    pos += 1  # not held (any more): a miss; lease the rest
                    continue
                try:
                    self._read_leased(client, lease, bufs[pos:], out, pos, patience_s)
                finally:
                    client.release_async(lease)  # the data is verified: do not wait
                pos += len(lease.blocks)
        except (KVDBError, TransferError, OSError, grpc.RpcError) as exc:
            unanswered = self._failed_read(node, exc, patience_s)
            return PeerRead([f if f.too_small else MISS for f in out], unanswered)
        self._answered(node)
        return PeerRead(out, False)

    @staticmethod
    def _read_leased(
        client: RemoteClient,
        lease: Any,
        bufs: Sequence[Any],
        out: list[Fetched],
        pos: int,
        patience_s: float,
    ) -> None:
        """Read the leased blocks that fit their buffers; their outcomes into ``out[pos:]``."""
        blocks = lease.blocks
        fit = []
        for i, block in enumerate(blocks):
            if block.length <= len(bufs[i]):
                fit.append(i)
            else:
                out[pos + i] = Fetched(None, block.length)
        if not fit:
            return
        sub = dataclasses.replace(lease, blocks=tuple(blocks[i] for i in fit))
        got = client.read_into(sub, [bufs[i][: blocks[i].length] for i in fit], patience_s)
        for i, tier in zip(fit, got, strict=True):
            out[pos + i] = MISS if tier is None else Fetched("remote", blocks[i].length)

    def size_of(self, node: NodeId, key: bytes, patience_s: float = 0.0) -> PeerRead[int | None]:
        """The size of ``key``'s value on ``node`` (a lease, released at once), or None.
        ``patience_s`` > 0: a last-resort try (module doc)."""
        client = self._client(node)
        if client is None or self._gave_up_on(node, patience_s):
            return PeerRead(None, False)
        try:
            lease = client.lease([key], patience_s=patience_s)
        except (KVDBError, TransferError, OSError, grpc.RpcError) as exc:
            return PeerRead(None, self._failed_read(node, exc, patience_s))
        self._answered(node)
        client.release_async(lease)
        return PeerRead(lease.blocks[0].length if lease.blocks else None, False)

    def close(self) -> None:
        with self._lock:
            clients = [c for _, c in self._clients.values()]
            self._clients = {}
        for client in clients:
            client.close()


__all__ = ["PeerRead", "Peers", "format_member_address", "parse_member_address"]
