"""RemoteClient: read blocks from another node's DRAM through the transfer engine.

One ``batch_get_into(keys, bufs)`` is: a Lease RPC to the holder's BlockService (it pins the
leading blocks it holds, promoting SSD hits into DRAM, and says where they lie in its DRAM
segment), ONE transfer batch of READs, a checksum check of every block, and a Release RPC.

Where the bytes land. A destination that lies inside memory registered with
``register_destination`` (e.g. the whole KV page pool, registered once) is read into
directly: zero copies on this side, and the checksum is computed over the destination. Any
other destination is read into a registered staging buffer first, verified there and then
copied, because the transfer engine can only write into registered memory and registering a
buffer per call would cost more than the copy (and leave registrations behind). So: register
the page pool once and pass views of it.

Misses, not errors: a key past the leased prefix, a failed transfer and a failed checksum give
None for that block. On a direct read a failed block's destination holds unspecified bytes; on
a staged read it is untouched. Control-plane failures (holder unreachable, refused request)
raise RemoteReadError; a size mismatch raises ValueSizeError before any byte moves.

Hung holders. Every call has a deadline sized to its bytes (``config.budget``, a
``PeerCallBudget``) and reports to the holder's ``CircuitBreaker`` (``breaker``; pass the
process's shared one from ``PeerBreakers``): a Lease or read that timed out opens it at once,
other failures count. While it is open ``batch_get_into`` raises ``RemoteReadError`` at once
without calling the holder (``stats().skipped``), so a paused holder costs one deadline per
``open_s``, not one per read. A failed checksum is the data's fault, not the holder's.
A ``RemoteReadError`` says whether the holder timed out (``timed_out``) or was skipped for its
open breaker (``skipped``): then it did not *answer*, and a caller for which a miss is an answer
may try it once more with ``patience_s`` (the budget's ``last_resort_s``): every deadline of
that call is at least that long, and the breaker does not skip it (it still hears the outcome).

Thread-safety: every method is thread-safe; staged reads of concurrent calls are serialised by
one lock (direct reads are not).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import grpc
import numpy as np

from kvflow.kvdb.buffers import writable_bytes
from kvflow.kvdb.codec import checksum, key_seed
from kvflow.kvdb.copier import run_all
from kvflow.kvdb.errors import RemoteReadError, ValueSizeError
from kvflow.kvdb.proto import pb2, pb2_grpc
from kvflow.kvdb.remote.config import RemoteClientConfig
from kvflow.kvdb.remote.destinations import Destinations
from kvflow.kvdb.remote.peer_budget import PeerCallBudget
from kvflow.kvdb.remote.read_plan import Run, chunk_runs, plan_runs
from kvflow.kvdb.remote.types import RemoteBlock, RemoteLease, RemoteStats
from kvflow.kvdb.shard import check_key
from kvflow.replication import CircuitBreaker, Tier
from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_channel
from kvflow.transfer import (
    OpCode,
    SegmentHandle,
    TransferEngine,
    TransferError,
    TransferRequest,
    TransferState,
    TransferStatus,
)

logger = logging.getLogger(__name__)

_TIERS = {"dram": Tier.DRAM, "ssd": Tier.SSD}


class RemoteClient:
    """Reads from the holder whose BlockService is at ``control_address`` ("host:port") and
    whose transfer server is ``peer`` (its ``TransferEngine.peer_address``), using the local
    ``transfer`` engine. ``shard``: the holder's shard id ("" if it has one shard).
    ``channel``: an existing gRPC channel to reuse (not closed by ``close``). ``breaker``:
    the holder's circuit breaker, shared by every reader of it in the process (module doc);
    default: one of this client's own."""

    def __init__(
        self,
        control_address: str,
        transfer: TransferEngine,
        peer: str,
        *,
        shard: str = "",
        config: RemoteClientConfig | None = None,
        channel: grpc.Channel | None = None,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.config = config or RemoteClientConfig()
        self.budget: PeerCallBudget = self.config.budget
        self.breaker = breaker or CircuitBreaker(self.budget.breaker)
        self.peer = peer
        self.shard = shard
        self._transfer = transfer
        self._own_channel = channel is None
        self._channel = channel or cluster_channel(
            control_address, process_secret(), [("grpc.max_receive_message_length", 64 << 20)]
        )
        self._stub = pb2_grpc.BlockServiceStub(self._channel)
        self._memory = Destinations(transfer, self.config.staging_bytes)
        self._lock = threading.Lock()
        self._targets: dict[str, SegmentHandle] = {}
        self._releasing: set[Any] = set()
        self._counts = dict.fromkeys(
            ("leases", "hits", "misses", "transfer_failures", "checksum_failures", "skipped"),
            0,
        )
        self._counts.update(bytes_read=0, staged_bytes=0)
        self._closed = False

    # ----------------------------------------------------------------- registration

    def register_destination(self, buffer: Any) -> str:
        """Register ``buffer`` (writable, contiguous: numpy, CPU tensor, bytearray...) with
        the transfer engine once; later reads into views inside it go there directly. The
        caller keeps it alive until ``unregister_destination`` / ``close``. Returns its
        segment name."""
        return self._memory.register(buffer)

    def unregister_destination(self, name: str) -> None:
        self._memory.unregister(name)

    # ----------------------------------------------------------------- control plane

    def _call(self, method: Any, request: Any, what: str, timeout_s: float) -> Any:
        """One RPC with its deadline, reported to the breaker: an answer closes it (so a
        half-open probe always ends, also when the lease is empty), a failure counts and a
        timeout opens it; a failure is raised as RemoteReadError."""
        try:
            reply = method(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            timed_out = code == grpc.StatusCode.DEADLINE_EXCEEDED
            self._failed(timed_out=timed_out)
            raise RemoteReadError(
                f"{what} to {self.peer} failed after at most {timeout_s:.2f}s: {code}: {details}",
                timed_out=timed_out,
            ) from exc
        self.breaker.success()
        return reply

    def _failed(self, *, timed_out: bool) -> None:
        if timed_out:
            if self.breaker.trip():
                logger.warning("holder %s timed out; skipping it for a while", self.peer)
        elif self.breaker.failure():
            logger.warning("holder %s keeps failing; skipping it for a while", self.peer)

    def lease(self, keys: Sequence[bytes], nbytes: int = 0, patience_s: float = 0.0) -> RemoteLease:
        """Lease the leading ``keys`` the holder has (see the module doc), within the
        deadline of ``nbytes`` (the bytes asked for; the holder may promote them from SSD),
        or ``patience_s`` when longer (a last-resort try). Raises InvalidKeyError (bad key,
        nothing sent) or RemoteReadError."""
        checked = [check_key(k) for k in keys]
        reply = self._call(
            self._stub.Lease,
            pb2.LeaseRequest(shard=self.shard, keys=checked),
            "Lease",
            self.budget.patient_deadline_s(nbytes, patience_s),
        )
        with self._lock:
            self._counts["leases"] += 1
        blocks = tuple(
            RemoteBlock(
                b.offset,
                b.length,
                b.checksum,
                _TIERS.get(b.tier, Tier.DRAM),
                key_seed(key, b.parent or None, b.tenant),
                b.parent or None,
                b.tenant,
            )
            for key, b in zip(checked, reply.blocks, strict=False)
        )
        return RemoteLease(reply.lease_id, reply.segment, blocks, reply.timeout_s)

    def release(self, lease: RemoteLease) -> bool:
        """Give the lease back; False if the holder no longer knew it (expired) or could not
        be reached (then the lease simply times out there). Never raises for that."""
        if lease.lease_id == 0:
            return False
        try:
            reply = self._call(
                self._stub.Release,
                pb2.ReleaseRequest(lease_id=lease.lease_id),
                "Release",
                self.budget.deadline_s(0),
            )
        except RemoteReadError as exc:
            logger.warning("lease=%d not released: %s", lease.lease_id, exc)
            return False
        return bool(reply.released)

    def release_async(self, lease: RemoteLease) -> None:
        """``release`` without waiting for the answer (the holder drops the pins a moment
        later; a failure is logged and the lease then times out there). ``wait_released``
        and ``close`` wait for the outstanding ones."""
        if lease.lease_id == 0:
            return
        future = self._stub.Release.future(
            pb2.ReleaseRequest(lease_id=lease.lease_id), timeout=self.budget.deadline_s(0)
        )
        with self._lock:
            self._releasing.add(future)
        future.add_done_callback(lambda f, lease_id=lease.lease_id: self._released(f, lease_id))

    def _released(self, future: Any, lease_id: int) -> None:
        with self._lock:
            self._releasing.discard(future)
        if future.cancelled() or future.exception() is not None:
            logger.warning("lease=%d not released: %s", lease_id, future.exception())

    def wait_released(self) -> None:
        """Block until every ``release_async`` sent so far has been answered (or failed)."""
        with self._lock:
            pending = list(self._releasing)
        for future in pending:
            future.exception()  # blocks until answered; a failure is logged by the callback

    # ----------------------------------------------------------------- data plane

    def _target(self, segment: str) -> SegmentHandle:
        with self._lock:
            handle = self._targets.get(segment)
        if handle is None:
            handle = self._transfer.open_segment(self.peer, segment)
            with self._lock:
                self._targets[segment] = handle
        return handle

    def read_into(
        self, lease: RemoteLease, bufs: Sequence[Any], patience_s: float = 0.0
    ) -> list[Tier | None]:
        """Copy the lease's blocks into ``bufs`` (one per block, in order, each exactly the
        block's length; ValueSizeError otherwise, before anything moves) with one transfer
        batch, verifying every checksum, within the deadline of the leased bytes (or
        ``patience_s`` when longer). Returns per
        block the holder's tier, or None. Reports to the breaker: a transfer that timed out
        (or a segment that could not be opened) opens it, other transfer failures count."""
        if len(bufs) != len(lease.blocks):
            raise ValueError(f"{len(lease.blocks)} leased blocks but {len(bufs)} buffers")
        dsts = [writable_bytes(b) for b in bufs]
        for i, (dst, block) in enumerate(zip(dsts, lease.blocks, strict=True)):
            if dst.shape[0] != block.length:
                raise ValueSizeError(
                    f"bufs[{i}] has {dst.shape[0]} bytes, the block holds {block.length}"
                )
        if not dsts:
            return []
        try:
            target = self._target(lease.segment)
        except TransferError as exc:  # segment gone, holder's transfer server unreachable
            logger.info("lease=%d: cannot open segment=%s: %s", lease.lease_id, lease.segment, exc)
            with self._lock:
                self._counts["transfer_failures"] += len(dsts)
            self._failed(timed_out=True)
            return self._finish(lease, [False] * len(dsts))
        ok = [False] * len(dsts)
        nbytes = sum(b.length for b in lease.blocks)
        health = _Health(self.budget.patient_deadline_s(nbytes, patience_s))
        if target.backend == "shm":  # a holder on this host: its segment is mapped here
            self._read_mapped(lease, target, dsts, ok, health)
            return self._report(lease, ok, health)
        places = [self._memory.locate(dst) for dst in dsts]
        staged = [i for i, place in enumerate(places) if place is None]
        if staged:
            with self._memory.staging_lock:
                self._read_rounds(lease, target, dsts, places, staged, ok, health)
        else:
            self._read_rounds(lease, target, dsts, places, staged, ok, health)
        return self._report(lease, ok, health)

    def _report(self, lease: RemoteLease, ok: list[bool], health: _Health) -> list[Tier | None]:
        if health.timed_out or health.failed:
            self._failed(timed_out=health.timed_out)
        else:
            self.breaker.success()
        return self._finish(lease, ok)

    def _read_mapped(
        self,
        lease: RemoteLease,
        target: SegmentHandle,
        dsts: list[np.ndarray],
        ok: list[bool],
        health: _Health,
    ) -> None:
        """A same-host holder (``target`` is a shm handle): each block is copied out of the
        mapped segment straight into its buffer and checksummed there while it is still in
        cache (one pass less over memory than a transfer followed by a check), on two threads
        for a large read (kvdb/copier.py); no transfer batch, no staging buffer. Each copy
        asks the transfer engine for the block's window, which checks the holder is alive and
        the segment registered."""
        blocks = lease.blocks
        errors: list[str] = []
        failed: list[int] = []  # blocks of the runs whose window could not be had
        corrupt: list[int] = []
        # runs of blocks back to back in the segment, one window (one check) each: the
        # local side is each block's own buffer, so only the remote offsets decide
        runs = plan_runs([("", b.offset, b.offset, b.length) for b in blocks])

        def read(run: Run) -> bool:
            try:
                window = self._transfer.mapped_window(target, run.remote_offset, run.length)
            except TransferError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                failed.extend(range(run.first, run.first + run.count))
                return False
            src = np.frombuffer(window, dtype=np.uint8)
            for i in range(run.first, run.first + run.count):
                block = blocks[i]
                at = block.offset - run.remote_offset
                np.copyto(dsts[i], src[at : at + block.length])
                if checksum(dsts[i], block.seed) == block.checksum:  # while it is in cache
                    ok[i] = True
                else:
                    corrupt.append(i)
            return True

        run_all([partial(read, run) for run in runs], [run.length for run in runs])
        if errors:
            health.failed = True
            first = errors[0]
            logger.info("lease=%d: %d mapped reads failed: %s", lease.lease_id, len(errors), first)
            if any(e.startswith("UnknownSegmentError") for e in errors):
                with self._lock:
                    self._targets.pop(lease.segment, None)
        if corrupt:
            logger.info("lease=%d: %d blocks failed their checksum", lease.lease_id, len(corrupt))
        with self._lock:
            self._counts["transfer_failures"] += len(failed)
            self._counts["checksum_failures"] += len(corrupt)

    def _read_rounds(
        self,
        lease: RemoteLease,
        target: SegmentHandle,
        dsts: list[np.ndarray],
        places: list[tuple[str, int] | None],
        staged: list[int],
        ok: list[bool],
        health: _Health,
    ) -> None:
        """Direct reads go in the first batch with as many staged reads as the staging buffer
        holds; further staged reads follow in more batches."""
        blocks = lease.blocks
        direct = [i for i, place in enumerate(places) if place is not None]
        staging: tuple[str, np.ndarray] | None = None
        if staged:
            staging = self._memory.staging(max(blocks[i].length for i in staged))
        pending = list(staged)
        first = True
        while first or pending:
            round_items: list[tuple[int, str, int]] = []
            if first:
                round_items = [(i, *places[i]) for i in direct]  # type: ignore[misc]
            used = 0
            while staging is not None and pending:
                length = blocks[pending[0]].length
                if used + length > staging[1].shape[0]:
                    break
                round_items.append((pending.pop(0), staging[0], used))
                used += length
            first = False
            if not round_items:
                break
            self._transfer_and_check(lease, target, round_items, dsts, staging, ok, health)

    def _transfer_and_check(
        self,
        lease: RemoteLease,
        target: SegmentHandle,
        items: list[tuple[int, str, int]],
        dsts: list[np.ndarray],
        staging: tuple[str, np.ndarray] | None,
        ok: list[bool],
        health: _Health,
    ) -> None:
        """Move ``items`` (block index, local segment, local offset) as runs of adjacent
        blocks (``read_plan``), submitted as chunks of runs at once (all within
        ``health.deadline_s`` of now); verify each chunk's blocks as soon as it completes,
        while the later chunks are still moving and its bytes are still in cache."""
        blocks = lease.blocks
        runs = plan_runs(
            [(name, offset, blocks[i].offset, blocks[i].length) for i, name, offset in items]
        )
        chunks = chunk_runs(runs)
        batches = []
        try:
            for lo, hi in chunks:
                batch = self._transfer.allocate_batch(hi - lo)
                batches.append(batch)
                requests = [
                    TransferRequest(
                        OpCode.READ, r.local_segment, r.local_offset, target, r.remote_offset,
                        r.length,
                    )
                    for r in runs[lo:hi]
                ]  # fmt: skip
                self._transfer.submit(batch, requests, deadline_s=health.deadline_s)
        except BaseException:
            for batch in batches:  # let what was submitted settle before freeing it
                self._transfer.wait(batch)
                self._transfer.free_batch(batch)
            raise
        for (lo, hi), batch in zip(chunks, batches, strict=True):
            statuses = self._transfer.wait(batch)  # bounded by the submit's deadline
            self._transfer.free_batch(batch)
            health.timed_out |= any(s.state is TransferState.TIMEOUT for s in statuses)
            health.failed |= any(not s.ok for s in statuses)
            settled = [
                (item, status)
                for run, status in zip(runs[lo:hi], statuses, strict=True)
                for item in items[run.first : run.first + run.count]
            ]
            self._check(lease, settled, dsts, staging, ok)

    def _check(
        self,
        lease: RemoteLease,
        settled: list[tuple[tuple[int, str, int], TransferStatus]],
        dsts: list[np.ndarray],
        staging: tuple[str, np.ndarray] | None,
        ok: list[bool],
    ) -> None:
        transfer_failures = checksum_failures = staged_bytes = 0
        for (i, name, offset), status in settled:
            block = lease.blocks[i]
            if not status.ok:
                transfer_failures += 1
                logger.info(
                    "remote read of block %d (lease=%d) failed: %s", i, lease.lease_id, status.error
                )
                if status.error and status.error.startswith("UnknownSegmentError"):
                    with self._lock:
                        self._targets.pop(lease.segment, None)
                continue
            if staging is not None and name == staging[0]:
                data = staging[1][offset : offset + block.length]
                if checksum(data, block.seed) == block.checksum:
                    dsts[i][:] = data
                    ok[i] = True
                    staged_bytes += block.length
                else:
                    checksum_failures += 1
            elif checksum(dsts[i], block.seed) == block.checksum:
                ok[i] = True
            else:
                checksum_failures += 1
        if checksum_failures:
            logger.info(
                "lease=%d: %d blocks failed their checksum", lease.lease_id, checksum_failures
            )
        with self._lock:
            self._counts["transfer_failures"] += transfer_failures
            self._counts["checksum_failures"] += checksum_failures
            self._counts["staged_bytes"] += staged_bytes

    def _finish(self, lease: RemoteLease, ok: list[bool]) -> list[Tier | None]:
        out = [b.tier if good else None for b, good in zip(lease.blocks, ok, strict=True)]
        hits = sum(ok)
        with self._lock:
            self._counts["hits"] += hits
            self._counts["misses"] += len(ok) - hits
            self._counts["bytes_read"] += sum(
                b.length for b, g in zip(lease.blocks, ok, strict=True) if g
            )
        return out

    def batch_get_into(
        self, keys: Sequence[bytes], bufs: Sequence[Any], patience_s: float = 0.0
    ) -> list[Tier | None]:
        """Lease, read, verify, release (asynchronously): per key the tier the holder had it
        in, or None (not held past the leading run, transfer or checksum failure).
        ``patience_s`` > 0: a last-resort try (module doc): not skipped for an open breaker,
        every deadline at least that long."""
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        self._check_open()
        if not keys:
            return []
        checked = [check_key(k) for k in keys]  # bad input fails before the breaker is asked
        if not patience_s and not self.breaker.allow():
            with self._lock:
                self._counts["skipped"] += 1
            raise RemoteReadError(
                f"holder {self.peer}: circuit open (it timed out or failed recently)",
                skipped=True,
            )
        try:
            lease = self.lease(checked, sum(_nbytes(b) for b in bufs), patience_s)
        except RemoteReadError:
            raise  # reported to the breaker by _call
        except BaseException:
            self.breaker.failure()  # an allowed probe must report; the call did not complete
            raise
        try:
            got = self.read_into(lease, bufs[: len(lease.blocks)], patience_s)
        finally:
            self.release_async(lease)  # the data is verified: do not wait for the unpin
        missing = len(keys) - len(got)
        if missing:
            with self._lock:
                self._counts["misses"] += missing
        return got + [None] * missing

    def get_into(self, key: bytes, buf: Any) -> Tier | None:
        """``batch_get_into`` of one key."""
        return self.batch_get_into([key], [buf])[0]

    # ----------------------------------------------------------------- state

    def stats(self) -> RemoteStats:
        with self._lock:
            return RemoteStats(**self._counts)

    def _check_open(self) -> None:
        if self._closed:
            raise RemoteReadError("remote client is closed")

    def close(self) -> None:
        """Wait for outstanding releases, unregister this client's destinations and staging
        buffer, close its channel if it made it. Idempotent."""
        self.wait_released()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        names = self._memory.forget_all()
        for name in names:
            try:
                self._transfer.unregister_memory(name)
            except Exception:  # the engine may already be closed
                logger.debug("unregister %s failed", name, exc_info=True)
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> RemoteClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Health:
    """What one read saw of the holder: its deadline and whether a transfer timed out or
    failed (reported to the breaker once, at the end)."""

    __slots__ = ("deadline_s", "failed", "timed_out")

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.timed_out = False
        self.failed = False


def _nbytes(buf: Any) -> int:
    """Bytes of a destination buffer (numpy, tensor, bytearray...), for sizing a deadline."""
    nbytes = getattr(buf, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    return int(memoryview(buf).nbytes)


__all__ = ["RemoteBlock", "RemoteClient", "RemoteLease", "RemoteStats"]
