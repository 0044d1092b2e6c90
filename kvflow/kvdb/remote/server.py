"""BlockService: the holder's half of the remote read path.

The holder registers each shard's DRAM pool with its TransferEngine as segment
``kvdb-dram:<shard id>``. A reader calls ``Lease(keys)``: the holder pins the leading blocks it
holds (promoting SSD-only ones into DRAM) and answers, per block, (offset, length, checksum) in
that segment. The reader then READs the extents with its own TransferEngine, verifies the
checksums and calls ``Release``. A lease that is not released lapses after
``lease_timeout_s`` (a reaper thread and every Lease call drop expired leases), so a dead
reader cannot pin blocks forever.

``Store`` is the other direction, the synchronous half of a put with N replicas
(``replica_writer.py``): a writer sends blocks; each is checked against its checksum, put into
the shard and, before the answer, recorded in the metadata (``record``), so an acknowledged
copy is one the cluster knows about. A server built without ``record`` refuses ``Store``.

Thread-safety: every method is thread-safe. ``close()`` stops the reaper, releases every
outstanding lease and unregisters the segments.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from kvflow.kvdb.admin import AdminSource, ShardRef
from kvflow.kvdb.codec import block_checksum
from kvflow.kvdb.errors import (
    InvalidRequestError,
    StoreClosedError,
    StoreFullError,
    UnknownShardError,
    ValueSizeError,
)
from kvflow.kvdb.grpc_mount import method_names, servicer_for
from kvflow.kvdb.keys import KEY_BYTES, BlockKey
from kvflow.kvdb.proto import BLOCK_SERVICE_NAME, pb2, pb2_grpc
from kvflow.kvdb.remote.config import BlockServiceConfig
from kvflow.kvdb.remote.leases import Lease, LeaseTable
from kvflow.transfer import SegmentExistsError, TransferEngine, UnknownSegmentError

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "kvdb-dram:"


def segment_name(shard_id: str) -> str:
    """The transfer segment that holds shard ``shard_id``'s DRAM pool."""
    return SEGMENT_PREFIX + shard_id


class BlockServer:
    """Leases over the shards of ``source``, whose DRAM pools it registers with ``transfer``
    (the engine whose server readers reach). ``clock``: monotonic seconds, for expiry.
    ``record``: writes the shards' pending block events to the metadata now (``Store`` calls
    it before answering); None: ``Store`` is refused (no metadata to record copies in)."""

    def __init__(
        self,
        source: AdminSource,
        transfer: TransferEngine,
        config: BlockServiceConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        reaper: bool = True,
        record: Callable[[], object] | None = None,
    ) -> None:
        self.config = config or BlockServiceConfig()
        self._record = record
        self._source = source
        self._transfer = transfer
        self._clock = clock
        self.leases = LeaseTable()
        self._lock = threading.Lock()
        self._segments: dict[str, str] = {}  # shard id -> segment name we registered
        self._stop = threading.Event()
        self._closed = False
        for sid in list(source.shards):
            self._segment(sid, self._ref(sid))
        self._reaper: threading.Thread | None = None
        if reaper:
            self._reaper = threading.Thread(
                target=self._reap, name="kvdb-lease-reaper", daemon=True
            )
            self._reaper.start()

    # ----------------------------------------------------------------- plumbing

    def _ref(self, shard_id: str) -> ShardRef:
        shards = self._source.shards
        if not shard_id:
            if len(shards) != 1:
                raise InvalidRequestError(
                    f"shard is required: this server holds {len(shards)} shards {sorted(shards)}"
                )
            shard_id = next(iter(shards))
        ref = shards.get(shard_id)
        if ref is None:
            raise UnknownShardError(f"no shard {shard_id!r} here; shards: {sorted(shards)}")
        return ShardRef(*ref)

    def _shard_id(self, shard_id: str) -> str:
        return shard_id or next(iter(self._source.shards))

    def _segment(self, shard_id: str, ref: ShardRef) -> str | None:
        """The shard's DRAM segment, registered on first use; None without a DRAM tier."""
        with self._lock:
            name = self._segments.get(shard_id)
            if name is not None:
                return name
            pool = ref.shard.dram_pool
            if pool is None or pool.shape[0] == 0:
                return None
            name = segment_name(shard_id)
            try:
                # Peers only READ blocks out of it: its bytes change by this shard's puts
                # alone (what lets a shard skip checksums on its own DRAM hits).
                self._transfer.register_memory(name, pool, peer_writable=False)
            except SegmentExistsError:
                raise InvalidRequestError(
                    f"transfer segment {name!r} is already registered by someone else"
                ) from None
            self._segments[shard_id] = name
            logger.info("block service: shard=%s DRAM pool is segment=%s", shard_id, name)
            return name

    def _unpin(self, lease: Lease) -> None:
        ref = self._source.shards.get(lease.shard)
        if ref is None:
            logger.warning("lease=%d: shard=%s is gone", lease.lease_id, lease.shard)
            return
        ShardRef(*ref).shard.release_dram(lease.keys)

    def expire(self, now: float | None = None) -> int:
        """Drop the leases due at ``now`` (default: the clock) and unpin their blocks; returns
        how many were dropped."""
        expired = self.leases.expire(self._clock() if now is None else now)
        for lease in expired:
            logger.info(
                "lease=%d expired: unpinning %d blocks of shard=%s",
                lease.lease_id,
                len(lease.keys),
                lease.shard,
            )
            self._unpin(lease)
        return len(expired)

    def _reap(self) -> None:
        while not self._stop.wait(self.config.reap_interval_s):
            try:
                self.expire()
            except Exception:
                logger.exception("lease reaper failed")

    # ----------------------------------------------------------------- RPCs

    def Lease(self, request: Any) -> Any:
        keys = list(request.keys)
        if len(keys) > self.config.max_keys:
            raise InvalidRequestError(
                f"a lease may name at most {self.config.max_keys} keys, got {len(keys)}"
            )
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise InvalidRequestError(f"keys[{i}] has {len(key)} bytes, a key has {KEY_BYTES}")
        ref = self._ref(request.shard)
        shard_id = self._shard_id(request.shard)
        if self._closed:
            raise StoreClosedError("the block service is closed")
        self.expire()
        segment = self._segment(shard_id, ref)
        timeout = self.config.lease_timeout_s
        if segment is None or not keys:
            return pb2.LeaseResponse(lease_id=0, segment=segment or "", timeout_s=timeout)
        blocks = ref.shard.lease_dram(keys, promote=self.config.promote)
        if not blocks:
            return pb2.LeaseResponse(lease_id=0, segment=segment, timeout_s=timeout)
        lease = self.leases.grant(
            shard_id, tuple(BlockKey(b.key) for b in blocks), self._clock(), timeout
        )
        if self._closed and self.leases.release(lease.lease_id) is not None:
            self._unpin(lease)  # close() drained the table before this lease entered it
            raise StoreClosedError("the block service is closed")
        return pb2.LeaseResponse(
            lease_id=lease.lease_id,
            segment=segment,
            timeout_s=timeout,
            blocks=[
                pb2.LeasedBlock(
                    offset=b.offset,
                    length=b.nbytes,
                    checksum=b.checksum,
                    tier=b.tier.name.lower(),
                    parent=b.parent or b"",
                    tenant=b.tenant,
                )
                for b in blocks
            ],
        )

    def Release(self, request: Any) -> Any:
        lease = self.leases.release(request.lease_id)
        if lease is None:
            return pb2.ReleaseResponse(released=False, blocks=0)
        self._unpin(lease)
        return pb2.ReleaseResponse(released=True, blocks=len(lease.keys))

    def Store(self, request: Any) -> Any:
        """Put each sent block (checked against its checksum first; any bad block refuses the
        whole request, nothing stored), record the copies in the metadata, answer per block
        whether it is held. A block that does not fit (size, full tier) is ``held=False``."""
        if self._record is None:
            raise InvalidRequestError("this block service takes no copies (it has no metadata)")
        blocks = list(request.blocks)
        if len(blocks) > self.config.max_keys:
            raise InvalidRequestError(
                f"a store may carry at most {self.config.max_keys} blocks, got {len(blocks)}"
            )
        checked = [_checked(i, b) for i, b in enumerate(blocks)]
        ref = self._ref(request.shard)
        if self._closed:
            raise StoreClosedError("the block service is closed")
        held = []
        for key, value, parent, tenant in checked:
            try:
                tier = ref.shard.put(key, value, parent, tenant)
            except (ValueSizeError, StoreFullError) as exc:
                logger.warning("store: key=%s not taken: %s", key.hex(), exc)
                tier = None
            held.append(tier is not None)
        if any(held):
            self._record()
        return pb2.StoreResponse(held=held)

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stop the reaper, release every lease, unregister the segments. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            segments = list(self._segments.values())
            self._segments.clear()
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join()
        for lease in self.leases.drain():
            self._unpin(lease)
        for name in segments:
            with contextlib.suppress(UnknownSegmentError):
                self._transfer.unregister_memory(name)

    def __enter__(self) -> BlockServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checked(i: int, block: Any) -> tuple[bytes, np.ndarray, bytes | None, str]:
    """(key, value, parent, tenant) of a sent block; InvalidRequestError naming what is wrong."""
    key, parent, tenant = bytes(block.key), bytes(block.parent) or None, block.tenant
    if len(key) != KEY_BYTES:
        raise InvalidRequestError(f"blocks[{i}].key has {len(key)} bytes, a key has {KEY_BYTES}")
    if parent is not None and len(parent) != KEY_BYTES:
        raise InvalidRequestError(f"blocks[{i}].parent has {len(parent)} bytes, not {KEY_BYTES}")
    if not tenant.isascii():
        raise InvalidRequestError(f"blocks[{i}].tenant must be ASCII, got {tenant!r}")
    value = np.frombuffer(block.value, dtype=np.uint8)
    if block_checksum(key, parent, tenant, value) != block.checksum:
        raise InvalidRequestError(f"blocks[{i}] (key={key.hex()}) fails its checksum")
    return key, value, parent, tenant


def add_block_service(
    server: grpc.Server | grpc.aio.Server,
    source: AdminSource,
    transfer: TransferEngine,
    config: BlockServiceConfig | None = None,
    record: Callable[[], object] | None = None,
) -> BlockServer:
    """Register the BlockService for ``source`` on ``server`` (before it starts), with DRAM
    pools exposed through ``transfer`` (start its server so readers can reach it). Returns the
    BlockServer: close it when the server stops. Add ``BLOCK_SERVICE_NAME`` to reflection.
    ``record``: see ``BlockServer`` (pass the store's ``flush_metadata`` to take copies)."""
    core = BlockServer(source, transfer, config, record=record)
    descriptor = pb2.DESCRIPTOR.services_by_name["BlockService"]
    servicer = servicer_for(server, core, pb2_grpc.BlockServiceServicer, method_names(descriptor))
    pb2_grpc.add_BlockServiceServicer_to_server(servicer, server)
    return core


__all__ = [
    "BLOCK_SERVICE_NAME",
    "BlockServer",
    "add_block_service",
    "segment_name",
]
