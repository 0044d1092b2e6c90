"""ReplicaWriter: the synchronous half of a put with N replicas — acknowledged means durable.

A writer that has put blocks into its own shard (or has no room for them: a client that
contributes no storage) calls ``write(blocks, n, held_locally)``. The writer's copy counts as
one when it holds it; the others are pushed to peers chosen by the placement code
(``replication.choose_targets``: live members of the accepted kinds, least loaded first) with
the BlockService ``Store`` RPC, which checks each value's checksum, stores it and records it in
the metadata before answering. A peer that fails or refuses is replaced by the next candidate.
``write`` returns only when N distinct nodes hold every block and the metadata records them
(plus the replica target, so the background replicator restores a lost copy later); otherwise
it raises ``NotEnoughReplicasError`` and nothing is acknowledged.

This is the one mechanism behind kvdb's ``EmbeddedClient.put(..., replicas=N)`` and the
Mooncake-compatible ``put`` with ``ReplicateConfig.replica_num`` (through ``ClusterMember``).
Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from kvflow.kvdb.buffers import readable_bytes
from kvflow.kvdb.codec import block_checksum
from kvflow.kvdb.errors import NotEnoughReplicasError
from kvflow.kvdb.proto import pb2, pb2_grpc
from kvflow.replication import NodeId, NodeLoad, ReplicationError, Tier, choose_targets
from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_channel

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 96 << 20  # a Store carries up to one 64 MiB value plus its framing
PUSH_BASE_S = 10.0  # a push's deadline: this plus its bytes at PUSH_MIN_BYTES_PER_S
PUSH_MIN_BYTES_PER_S = 20 << 20


@dataclass(frozen=True)
class BlockToCopy:
    """One block a writer wants replicated: the bytes it stored, its parent and owner."""

    key: bytes
    value: Any  # bytes-like / numpy / CPU tensor
    parent: bytes | None
    tenant: str


class ReplicaWriter:
    """Pushes copies for ``node`` (this process's node id). ``metadata``: a MetadataGroup or
    RemoteMetadata (``view()``, ``set_replica_target``); ``record``: writes this process's
    pending block events to the metadata now (its own copy, recorded before the pushes).
    ``kinds``: the node kinds that take copies; ``dead_after_s``: a node whose last heartbeat
    is older is not a candidate. ``clock``: wall time, the heartbeats' clock."""

    def __init__(
        self,
        node: NodeId,
        metadata: Any,
        record: Callable[[], object],
        *,
        kinds: frozenset[str],
        dead_after_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self._metadata = metadata
        self._record = record
        self._kinds = kinds
        self._dead_after_s = dead_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, Any]] = {}
        self._pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvdb-push")
        self.pushes = 0
        self.push_failures = 0

    # ----------------------------------------------------------------- candidates

    def candidates(self) -> dict[NodeId, tuple[NodeLoad, str]]:
        """Live peers that take copies: their load (blocks held) and control address."""
        view = self._metadata.view()
        now = self._clock()
        out: dict[NodeId, tuple[NodeLoad, str]] = {}
        for info in view.nodes():
            control, sep, _ = info.address.partition("|")
            if info.node == self.node or info.kind not in self._kinds or not (sep and control):
                continue
            if now - info.last_heartbeat <= self._dead_after_s:
                out[info.node] = (NodeLoad(info.node, view.blocks_on(info.node)), control)
        return out

    # ----------------------------------------------------------------- writes

    def write(self, blocks: Sequence[BlockToCopy], n: int, held_locally: bool) -> list[NodeId]:
        """Make ``blocks`` held by ``n`` distinct nodes (this one counts if ``held_locally``);
        returns the peers that took copies. Raises NotEnoughReplicasError (too few live
        candidates, or too few took a copy) and ValueError for ``n`` < 1."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"replicas must be an int >= 1, got {n!r}")
        try:
            return self._write(blocks, n, held_locally)
        except (ReplicationError, grpc.RpcError) as exc:  # the metadata, not a peer
            raise NotEnoughReplicasError(
                f"replicas={n}: the metadata could not list or record the copies: {exc}"
            ) from exc

    def _write(self, blocks: Sequence[BlockToCopy], n: int, held_locally: bool) -> list[NodeId]:
        need = n - int(held_locally)
        if not blocks or need <= 0:
            if blocks and n > 1:
                self._targets(blocks, n)
            return []
        candidates = self.candidates()
        if len(candidates) < need:
            raise NotEnoughReplicasError(
                f"replicas={n} needs {need} live peer(s) besides node={self.node} to take a "
                f"copy, {len(candidates)} live: {sorted(candidates)}"
            )
        if held_locally:
            self._record()  # the metadata knows our copy before anyone else's
        request = self._request(blocks)
        loads = [load for load, _ in candidates.values()]
        done: list[NodeId] = []
        tried: set[NodeId] = {self.node}
        while len(done) < need:
            taken = {x: Tier.DRAM for x in tried}
            picks = choose_targets(taken, len(taken) + need - len(done), loads)
            if not picks:
                failed = sorted(tried - {self.node, *done})
                raise NotEnoughReplicasError(
                    f"replicas={n}: only {len(done) + int(held_locally)} node(s) took a copy "
                    f"(pushed to {done}); the other live peers failed: {failed}"
                )
            tried.update(picks)
            pushed = self._pool.map(lambda p: self._push(p, candidates[p][1], request), picks)
            done.extend(p for p, ok in zip(picks, pushed, strict=True) if ok)
        self._targets(blocks, n)
        return done

    def _request(self, blocks: Sequence[BlockToCopy]) -> Any:
        sent = []
        for b in blocks:
            value = readable_bytes(b.value)
            sent.append(
                pb2.StoredBlock(
                    key=bytes(b.key),
                    value=value.tobytes() if isinstance(value, np.ndarray) else bytes(value),
                    parent=b.parent or b"",
                    tenant=b.tenant,
                    checksum=block_checksum(b.key, b.parent, b.tenant, value),
                )
            )
        return pb2.StoreRequest(shard="", blocks=sent)

    def _push(self, peer: NodeId, control: str, request: Any) -> bool:
        """One Store call; True if ``peer`` holds every block now."""
        nbytes = sum(len(b.value) for b in request.blocks)
        timeout = PUSH_BASE_S + nbytes / PUSH_MIN_BYTES_PER_S
        try:
            reply = self._stub(control).Store(
                pb2.StoreRequest(shard=str(peer), blocks=request.blocks), timeout=timeout
            )
            ok = len(reply.held) == len(request.blocks) and all(reply.held)
        except grpc.RpcError as exc:
            logger.warning("push to peer=%s failed: %s", peer, exc.code())
            self._drop(control)
            ok = False
        with self._lock:
            self.pushes += 1
            self.push_failures += not ok
        if not ok:
            logger.warning("peer=%s did not take %d block(s)", peer, len(request.blocks))
        return ok

    def _targets(self, blocks: Sequence[BlockToCopy], n: int) -> None:
        now = self._clock()
        for b in blocks:
            self._metadata.set_replica_target(bytes(b.key), n, now)

    def _stub(self, control: str) -> Any:
        with self._lock:
            known = self._stubs.get(control)
            if known is None:
                options = [
                    ("grpc.max_send_message_length", MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MESSAGE_BYTES),
                ]
                channel = cluster_channel(control, process_secret(), options)
                known = (channel, pb2_grpc.BlockServiceStub(channel))
                self._stubs[control] = known
            return known[1]

    def _drop(self, control: str) -> None:
        with self._lock:
            known = self._stubs.pop(control, None)
        if known is not None:
            known[0].close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            stubs, self._stubs = list(self._stubs.values()), {}
        for channel, _ in stubs:
            channel.close()


__all__ = ["BlockToCopy", "ReplicaWriter"]
