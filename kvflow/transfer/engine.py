"""TransferEngine: the façade of the paper's Listing 1 over pluggable backends.

    engine = TransferEngine(TransferConfig())
    engine.register_memory("kv", buffer)                 # registerLocalMemory
    target = engine.open_segment("10.0.0.2:7000", "kv")  # openSegment
    batch = engine.allocate_batch(16)                    # allocateBatchID
    engine.submit(batch, [TransferRequest(...), ...])    # submitTransfer
    engine.get_status(batch) / engine.wait(batch, 5.0)   # getTransferStatus
    engine.free_batch(batch)                             # freeBatchID

The engine owns its registered segments, its batches, its backends and its servers; backends
see only a BackendContext. Every public method is thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

from kvflow.transfer.backends.base import Backend, BackendContext, TransferTask
from kvflow.transfer.batch import BatchTable
from kvflow.transfer.config import TransferConfig
from kvflow.transfer.errors import (
    BackendUnavailableError,
    EngineClosedError,
    UnknownSegmentError,
)
from kvflow.transfer.memory import LocalSegment, SegmentTable
from kvflow.transfer.protocol import parse_addresses
from kvflow.transfer.registry import backend_class
from kvflow.transfer.server import TcpServer
from kvflow.transfer.shared import host_id
from kvflow.transfer.shm_server import ShmServer
from kvflow.transfer.types import (
    LOCAL_PEER,
    SHM_SCHEME,
    BatchId,
    MemoryHandle,
    SegmentHandle,
    TransferRequest,
    TransferStatus,
)

logger = logging.getLogger(__name__)

DEFAULT_BACKENDS: tuple[str, ...] = ("local", "shm", "tcp")


class TransferEngine:
    """Registers memory, opens segments and runs batches of transfers over its backends.

    backends: names looked up in the registry, constructed in order; ``open_segment`` gives a
        peer to the first that ``handles`` it. Asking for an unavailable one (e.g. "rdma" on a
        host without devices) raises BackendUnavailableError.
    clock: monotonic seconds, injectable for tests (deadlines of requests).
    """

    def __init__(
        self,
        config: TransferConfig | None = None,
        backends: Sequence[str] = DEFAULT_BACKENDS,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config if config is not None else TransferConfig()
        self._segments = SegmentTable()
        self._batches = BatchTable(clock)
        self._context = BackendContext(self.config, self._segments, clock)
        self._backends: dict[str, Backend] = {}
        self._servers: dict[tuple[str, int], TcpServer] = {}
        self._shm_server: ShmServer | None = None
        self._shm_failed = False
        self._lock = threading.Lock()
        self._closed = False
        if isinstance(backends, str) or not backends:
            raise ValueError(f"backends must be a non-empty sequence of names, got {backends!r}")
        try:
            for name in backends:
                self._backends[name] = backend_class(name)(self._context)
        except BaseException:
            self.close()
            raise

    # ----- memory -----------------------------------------------------------------------------

    def register_memory(
        self,
        name: str,
        buffer: Any = None,
        *,
        shm: bool = False,
        size: int | None = None,
        peer_writable: bool = True,
    ) -> MemoryHandle:
        """Register memory that peers may read and write as segment ``name`` (mutates).

        Either ``buffer`` (anything writable with the buffer protocol, ``__array_interface__``
        or CPU ``__dlpack__``; a torch CPU tensor as ``t.view(torch.uint8).numpy()``), which the
        caller keeps alive and does not resize until unregister_memory; or ``shm=True`` with
        ``size``: the engine allocates shared memory, and the returned handle's ``buffer`` is
        the way to fill it. ``peer_writable`` False (a ``buffer`` only): remote peers may READ
        the segment; their WRITEs are refused with ReadOnlySegmentError (their status says so)
        and change nothing.

        Memory of a shared pool (``shm=True``, or a ``buffer`` from
        ``pool_memory.pool_bytes(shared=True)``) is also served to authenticated same-host
        peers through this engine's shm socket (``shm_server.py``): they map it and copy
        with one memcpy; the handle's ``shm_name`` names that socket (None: not shared).

        Raises SegmentExistsError for a taken name, TypeError/ValueError for a bad buffer or size.
        """
        self._check_open()
        if shm:
            if buffer is not None:
                raise ValueError("register_memory: give either buffer or shm=True with size")
            if size is None:
                raise ValueError("register_memory: shm=True needs size")
            segment = self._segments.register_shared(name, size)
        else:
            if buffer is None:
                raise ValueError("register_memory: buffer is required unless shm=True")
            if size is not None:
                raise ValueError("register_memory: size is only for shm=True")
            segment = self._segments.register(name, buffer, peer_writable)
        if segment.region is not None:
            server = self._shm()
            if server is not None and server.share(segment):
                segment = self._segments.mark_shared(name, server.name)
        return _memory_handle(segment)

    def _shm(self) -> ShmServer | None:
        """This engine's shm server, started on first use; None where it cannot start."""
        with self._lock:
            if self._shm_server is None and not self._shm_failed:
                try:
                    self._shm_server = ShmServer(
                        self.config.engine_name, self.config.secret, self.config.io_timeout_s
                    )
                except OSError as exc:
                    self._shm_failed = True
                    logger.warning(
                        "engine=%s: no shm server (%s); same-host peers read over tcp",
                        self.config.engine_name,
                        exc,
                    )
            return self._shm_server

    def unregister_memory(self, name: str) -> None:
        """Forget segment ``name`` (same-host peers' mappings of it fail from now on);
        UnknownSegmentError if absent. Do not unregister memory that transfers are still
        using."""
        segment = self._segments.unregister(name)
        if segment.shm_name is not None and self._shm_server is not None:
            self._shm_server.unshare(name)

    def registered(self) -> list[str]:
        return self._segments.names()

    # ----- segments ---------------------------------------------------------------------------

    def open_segment(self, peer: str, name: str) -> SegmentHandle:
        """A handle to segment ``name`` of ``peer`` for use as TransferRequest.target.

        peer: ``"local"`` (this engine), ``"shm://<engine_name>"`` (same host, shared memory),
        or ``"host:port[,host:port...]"`` (a remote engine's server; several addresses are
        several paths). A tcp peer on this host whose segment is in shared memory gets a shm
        handle when config.prefer_shm; one of this engine's own server addresses gets a local
        handle. Raises UnknownSegmentError, PeerUnreachableError, ValueError for a peer that no
        enabled backend handles.
        """
        self._check_open()
        if not isinstance(peer, str) or not isinstance(name, str) or not name:
            raise ValueError(
                f"open_segment needs str peer and non-empty name, got {peer!r}, {name!r}"
            )
        if self._is_self(peer) and LOCAL_PEER in self._backends:
            return self._backends["local"].open_segment(LOCAL_PEER, name)
        backend = self._backend_for_peer(peer)
        if backend.name == "tcp" and self.config.prefer_shm and "shm" in self._backends:
            return self._open_maybe_shm(backend, peer, name)
        return backend.open_segment(peer, name)

    def _open_maybe_shm(self, tcp: Backend, peer: str, name: str) -> SegmentHandle:
        description = tcp.describe(peer, name)  # type: ignore[attr-defined]
        if description.shm_name and description.host_id == host_id():
            shm = self._backends["shm"]
            try:
                return shm.attach(  # type: ignore[attr-defined, no-any-return]
                    SHM_SCHEME + description.engine_name, name, description.shm_name
                )
            except UnknownSegmentError:
                logger.info("segment=%s of %s: shm not mappable, using tcp", name, peer)
        return SegmentHandle(tcp.name, peer, name, description.segment_id, description.size)

    def mapped_window(self, target: SegmentHandle, offset: int, length: int) -> memoryview:
        """The bytes ``[offset, offset + length)`` of a same-host segment (a ``shm`` handle),
        read-only, checked now as a transfer would be (owner alive, segment registered, in
        bounds): for a caller that copies and verifies them itself on its own threads (the
        kvdb reader copies a block and checksums it while it is in cache). Copy at once; a
        later copy must ask again. ValueError for a handle of another backend; the transfer
        errors otherwise."""
        self._check_open()
        if target.backend != "shm" or "shm" not in self._backends:
            raise ValueError(f"mapped_window needs a shm segment handle, got {target.backend!r}")
        view = self._backends["shm"].window(target, offset, length)  # type: ignore[attr-defined]
        return view.toreadonly()  # type: ignore[no-any-return]

    def _backend_for_peer(self, peer: str) -> Backend:
        for backend in self._backends.values():
            if backend.handles(peer):
                return backend
        raise ValueError(
            f"peer {peer!r} is not 'local', 'shm://<engine_name>' or 'host:port[,host:port...]' "
            f"for the enabled backends {sorted(self._backends)}"
        )

    def _is_self(self, peer: str) -> bool:
        if peer == LOCAL_PEER:
            return True
        try:
            addresses = parse_addresses(peer)
        except ValueError:
            return False
        with self._lock:
            return any(address in self._servers for address in addresses)

    # ----- batches ----------------------------------------------------------------------------

    def allocate_batch(self, capacity: int) -> BatchId:
        """A new empty batch for up to ``capacity`` requests; ValueError for a bad capacity."""
        self._check_open()
        limit = self.config.max_batch_capacity
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not 0 < capacity <= limit:
            raise ValueError(f"capacity must be an int in [1, {limit}], got {capacity!r}")
        return self._batches.allocate(capacity).batch_id

    def submit(
        self,
        batch_id: BatchId,
        requests: Iterable[TransferRequest],
        *,
        deadline_s: float | None = None,
    ) -> None:
        """Start ``requests`` in batch ``batch_id`` (appended after earlier submits).

        ``deadline_s``: seconds from now after which each of these requests ends TIMEOUT
        (a caller sizes it to the bytes, so a hung peer costs that, not more); default and
        ceiling ``config.request_timeout_s``; ValueError unless a positive number.

        Every request is checked before any starts: BatchNotFoundError, BatchCapacityError,
        UnknownSegmentError / OutOfBoundsError for the *local* side, BackendUnavailableError for
        a target of a backend this engine lacks, TypeError for a non-request. Problems on the
        remote side end up as FAILED statuses. The local windows belong to the engine until
        each request's status is terminal.
        """
        self._check_open()
        timeout_s = self._deadline(deadline_s)
        batch = self._batches.get(batch_id)
        requests = list(requests)
        prepared: list[tuple[TransferRequest, memoryview, Backend]] = []
        for request in requests:
            if not isinstance(request, TransferRequest):
                raise TypeError(f"submit expects TransferRequest, got {type(request).__name__}")
            local = self._segments.by_name(request.local_segment)
            window = local.window(request.local_offset, request.length)
            backend = self._backends.get(request.target.backend)
            if backend is None:
                raise BackendUnavailableError(
                    f"target backend {request.target.backend!r} is not enabled on this engine"
                )
            prepared.append((request, window, backend))
        progresses = batch.reserve([r.length for r in requests], timeout_s)
        grouped: dict[str, list[TransferTask]] = defaultdict(list)
        for (request, window, backend), progress in zip(prepared, progresses, strict=True):
            grouped[backend.name].append(TransferTask(request, window, progress))
        for backend_name, tasks in grouped.items():
            self._backends[backend_name].submit(tasks)

    def _deadline(self, deadline_s: float | None) -> float:
        ceiling = self.config.request_timeout_s
        if deadline_s is None:
            return ceiling
        if (
            not isinstance(deadline_s, int | float)
            or isinstance(deadline_s, bool)
            or not 0 < deadline_s < float("inf")
        ):
            raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
        return min(float(deadline_s), ceiling)

    def get_status(self, batch_id: BatchId) -> list[TransferStatus]:
        """Statuses of the batch's requests in submit order (snapshots; no mutation)."""
        return self._batches.get(batch_id).statuses()

    def wait(self, batch_id: BatchId, timeout: float | None = None) -> list[TransferStatus]:
        """Block until every request of the batch is terminal or ``timeout`` seconds pass,
        then return the statuses (some may still be WAITING/PENDING after a timeout)."""
        batch = self._batches.get(batch_id)
        batch.wait(timeout)
        return batch.statuses()

    def free_batch(self, batch_id: BatchId) -> None:
        """Release the batch id; BatchPendingError (nothing freed) while requests are running."""
        self._batches.free(batch_id)

    def transfer(
        self,
        requests: Sequence[TransferRequest],
        timeout: float | None = None,
        *,
        deadline_s: float | None = None,
    ) -> list[TransferStatus]:
        """allocate, submit (with ``deadline_s``, see ``submit``), wait and free in one call;
        returns the final statuses.

        If ``timeout`` passes first the batch is left allocated until it settles, and its
        statuses so far are returned.
        """
        batch_id = self.allocate_batch(max(1, len(requests)))
        try:
            self.submit(batch_id, requests, deadline_s=deadline_s)
        except BaseException:
            self._batches.free(batch_id)
            raise
        statuses = self.wait(batch_id, timeout)
        if all(status.done for status in statuses):
            self._batches.free(batch_id)
        return statuses

    # ----- server -----------------------------------------------------------------------------

    def start_server(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Serve this engine's segments to peers on host:port (0 = any free port).

        May be called several times: each listener is one more path to this engine. Returns the
        bound (host, port). OSError if the address cannot be bound.
        """
        self._check_open()
        server = TcpServer(self._segments, self.config)
        address = server.start(host, port)
        with self._lock:
            self._servers[address] = server
        return address

    def stop_server(self, address: tuple[str, int]) -> None:
        """Stop one listener and drop its connections; KeyError if it is not ours."""
        with self._lock:
            server = self._servers.pop(tuple(address))  # type: ignore[arg-type]
        server.stop()

    @property
    def peer_address(self) -> str:
        """This engine as a tcp peer string, ``"host:port[,host:port...]"`` ("" if no server)."""
        with self._lock:
            return ",".join(f"{host}:{port}" for host, port in self._servers)

    def server(self, address: tuple[str, int]) -> TcpServer:
        with self._lock:
            return self._servers[tuple(address)]  # type: ignore[index]

    def backend(self, name: str) -> Backend:
        """The live backend called ``name`` (for its statistics); KeyError if not enabled."""
        return self._backends[name]

    # ----- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop servers and backends (running transfers end FAILED), unregister everything.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            servers = list(self._servers.values())
            self._servers.clear()
            shm_server, self._shm_server = self._shm_server, None
        for server in servers:
            server.stop()
        if shm_server is not None:
            shm_server.stop()
        for backend in self._backends.values():
            backend.close()
        self._segments.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("transfer engine is closed")

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _memory_handle(segment: LocalSegment) -> MemoryHandle:
    return MemoryHandle(
        segment.name, segment.segment_id, segment.size, segment.shm_name, segment.view
    )
