"""The tcp backend: several connections per peer, sliced transfers, SIEVE pool, path failover.

A peer is ``"host:port[,host:port...]"``: every address is a *path* to the same engine (the
paper's several NICs; here several listeners of its server). Each peer gets
``connections_per_peer`` *lanes*; lane k prefers path k mod P. A request longer than
``slice_size`` is cut into slices dealt round-robin over the lanes, so one large transfer keeps
every connection busy. Connections live in an EndpointPool capped at ``max_endpoints`` (SIEVE
eviction). When a connection fails, its path is avoided for ``path_retry_s`` and its unfinished
slices are re-sent on the next path of the same lane, up to ``max_retries`` times per slice; a
slice whose request is past its deadline ends TIMEOUT. A watchdog thread fails connections that
make no progress for ``io_timeout_s`` while they have work.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Sequence

from kvflow.transfer.backends.base import Backend, BackendContext, TransferTask, settle_failed
from kvflow.transfer.endpoints import Endpoint, EndpointKey, EndpointPool, EndpointStats, Slice
from kvflow.transfer.errors import (
    EngineClosedError,
    OutOfBoundsError,
    PeerUnreachableError,
    ProtocolError,
    TransferTimeoutError,
    UnknownSegmentError,
)
from kvflow.transfer.handshake import client_handshake
from kvflow.transfer.protocol import (
    MAX_CONTROL_PAYLOAD,
    REQUEST,
    RESPONSE,
    STATUS_ERROR_NAMES,
    Op,
    SegmentDescription,
    Status,
    parse_addresses,
    recv_exact,
    send_parts,
    tune_socket,
)
from kvflow.transfer.registry import register_backend
from kvflow.transfer.types import OpCode, SegmentHandle

logger = logging.getLogger(__name__)

Address = tuple[str, int]


class _Peer:
    """The paths of one peer and its round-robin lane counter."""

    def __init__(self, paths: list[Address], lanes: int) -> None:
        self.paths = paths
        self.lanes = lanes
        self._next = itertools.count()

    def next_lane(self) -> int:
        return next(self._next) % self.lanes

    def lane_paths(self, lane: int) -> list[Address]:
        """The lane's paths, its preferred one (lane mod P) first, then the others in order."""
        first = lane % len(self.paths)
        return self.paths[first:] + self.paths[:first]


@register_backend
class TcpBackend(Backend):
    """Moves bytes to and from remote engines' TcpServers. Thread-safe."""

    name = "tcp"

    def __init__(self, context: BackendContext) -> None:
        super().__init__(context)
        config = context.config
        self._config = config
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._down_until: dict[Address, float] = {}
        self._stats: dict[EndpointKey, EndpointStats] = {}
        self._live: set[Endpoint] = set()
        self.pool = EndpointPool(config.max_endpoints)
        self.retries = 0
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None

    # ----- addressing -------------------------------------------------------------------------

    def handles(self, peer: str) -> bool:
        try:
            parse_addresses(peer)
        except ValueError:
            return False
        return True

    def _peer(self, peer: str) -> _Peer:
        with self._lock:
            state = self._peers.get(peer)
            if state is None:
                state = _Peer(parse_addresses(peer), self._config.connections_per_peer)
                self._peers[peer] = state
            return state

    def _ordered(self, paths: list[Address]) -> list[Address]:
        """Paths that are up first (order kept), then the ones marked down (still worth a try)."""
        now = self.context.clock()
        with self._lock:
            down = {p for p in paths if self._down_until.get(p, 0.0) > now}
        return [p for p in paths if p not in down] + [p for p in paths if p in down]

    def mark_down(self, address: Address) -> None:
        with self._lock:
            self._down_until[address] = self.context.clock() + self._config.path_retry_s

    def path_is_down(self, address: Address) -> bool:
        with self._lock:
            return self._down_until.get(address, 0.0) > self.context.clock()

    # ----- segments ---------------------------------------------------------------------------

    def describe(self, peer: str, name: str) -> SegmentDescription:
        """Ask the peer about segment ``name`` over a short-lived connection, path by path.

        UnknownSegmentError if the peer answers that it has none; PeerUnreachableError if no
        path answers.
        """
        errors: list[str] = []
        for address in self._ordered(self._peer(peer).paths):
            try:
                return self._describe_at(address, name)
            except (OSError, ProtocolError) as exc:
                self.mark_down(address)
                errors.append(f"{address[0]}:{address[1]}: {exc}")
        raise PeerUnreachableError(f"no path to peer {peer} answered: {'; '.join(errors)}")

    def _describe_at(self, address: Address, name: str) -> SegmentDescription:
        encoded = name.encode()
        with socket.create_connection(address, timeout=self._config.connect_timeout_s) as sock:
            if self._config.secret is not None:
                client_handshake(sock, self._config.secret)
            sock.settimeout(self._config.io_timeout_s)
            send_parts(sock, (REQUEST.pack(Op.DESCRIBE, 0, 0, 0, 1, 0, len(encoded)), encoded))
            status, _reserved, _request_id, length = RESPONSE.unpack(
                recv_exact(sock, RESPONSE.size)
            )
            if length > MAX_CONTROL_PAYLOAD:
                raise ProtocolError(f"DESCRIBE answer of {length} bytes")
            payload = recv_exact(sock, length)
        if status == Status.UNKNOWN_SEGMENT:
            raise UnknownSegmentError(payload.decode("utf-8", errors="replace"))
        if status != Status.OK:
            raise ProtocolError(f"{STATUS_ERROR_NAMES.get(status, status)}: {payload!r}")
        return SegmentDescription.decode(payload)

    def open_segment(self, peer: str, name: str) -> SegmentHandle:
        description = self.describe(peer, name)
        return SegmentHandle(self.name, peer, name, description.segment_id, description.size)

    # ----- transfers --------------------------------------------------------------------------

    def submit(self, tasks: Sequence[TransferTask]) -> None:
        if self._closed.is_set():
            for task in tasks:
                settle_failed(task, EngineClosedError("tcp backend is closed"))
            return
        slice_size = self._config.slice_size
        reads: dict[tuple[str, int], list[Slice]] = {}  # (peer, lane) -> READ slices
        for task in tasks:
            request = task.request
            target = request.target
            if request.remote_offset + request.length > target.size:
                settle_failed(
                    task,
                    OutOfBoundsError(
                        f"segment {target.name!r} of {target.peer} (size {target.size}): offset "
                        f"{request.remote_offset} + length {request.length} is out of bounds"
                    ),
                )
                continue
            peer = self._peer(target.peer)
            op = Op.READ if request.opcode is OpCode.READ else Op.WRITE
            starts = range(0, request.length, slice_size)
            task.progress.expect_slices(len(starts))
            for start in starts:
                window = task.local[start : start + slice_size]
                piece = Slice(
                    op,
                    target.peer,
                    target.segment_id,
                    request.remote_offset + start,
                    window,
                    task.progress,
                    peer.next_lane(),
                )
                if op == Op.READ:
                    reads.setdefault((target.peer, piece.lane), []).append(piece)
                else:
                    self._dispatch(piece, peer)
        for (peer_name, _lane), pieces in reads.items():
            self._dispatch_reads(pieces, self._peer(peer_name))

    def _dispatch_reads(self, pieces: list[Slice], peer: _Peer) -> None:
        """Put one lane's READ slices on its first path's endpoint with one header write;
        slice by slice (``_dispatch``, with its failover and errors) if that does not work."""
        for address in self._ordered(peer.lane_paths(pieces[0].lane)):
            key = EndpointKey(address, pieces[0].lane)
            try:
                endpoint = self.pool.acquire(key, lambda key=key: self._connect(key))
            except OSError:
                self.mark_down(address)
                continue
            if endpoint.send_reads(pieces):
                return
            break
        for piece in pieces:
            self._dispatch(piece, peer)

    def _dispatch(self, piece: Slice, peer: _Peer) -> None:
        """Put ``piece`` on its lane's first path that connects; fail it if none does."""
        errors: list[str] = []
        for address in self._ordered(peer.lane_paths(piece.lane)):
            key = EndpointKey(address, piece.lane)
            for _ in range(2):  # a pooled endpoint may retire between acquire and send
                try:
                    endpoint = self.pool.acquire(key, lambda key=key: self._connect(key))
                except OSError as exc:
                    self.mark_down(address)
                    errors.append(f"{address[0]}:{address[1]}: {exc}")
                    break
                if endpoint.send(piece):
                    return
        self._give_up(
            piece,
            PeerUnreachableError(
                f"no path to peer {piece.peer} for lane {piece.lane}: {'; '.join(errors) or 'busy'}"
            ),
        )

    def _connect(self, key: EndpointKey) -> Endpoint:
        if self._closed.is_set():
            raise EngineClosedError("tcp backend is closed")
        sock = socket.create_connection(key.address, timeout=self._config.connect_timeout_s)
        if self._config.secret is not None:
            try:
                client_handshake(sock, self._config.secret)
            except BaseException:
                sock.close()
                raise
        sock.settimeout(None)
        tune_socket(sock, self._config.socket_buffer_bytes)
        with self._lock:
            stats = self._stats.setdefault(key, EndpointStats())
        endpoint = Endpoint(key, sock, stats, self._on_endpoint_failure)
        with self._lock:
            self._live = {e for e in self._live if not e.finished}
            self._live.add(endpoint)
        self._start_watchdog()
        logger.debug("connected endpoint %s", key)
        return endpoint

    def _on_endpoint_failure(
        self, endpoint: Endpoint, slices: list[Slice], error: BaseException
    ) -> None:
        self.pool.remove(endpoint)
        with self._lock:
            self._live.discard(endpoint)
        closing = self._closed.is_set() or isinstance(error, EngineClosedError)
        if not closing:
            self.mark_down(endpoint.key.address)
        now = self.context.clock()
        for piece in slices:
            if closing:
                self._give_up(piece, EngineClosedError("transfer engine closed"))
            elif now >= piece.progress.deadline:
                self._give_up(
                    piece,
                    TransferTimeoutError(f"request past its deadline after: {error}"),
                    timeout=True,
                )
            elif piece.attempts >= self._config.max_retries or piece.progress.failed:
                self._give_up(
                    piece,
                    PeerUnreachableError(
                        f"slice failed {piece.attempts + 1} time(s), "
                        f"last on {endpoint.key}: {error}"
                    ),
                )
            else:
                piece.attempts += 1
                with self._lock:
                    self.retries += 1
                self._dispatch(piece, self._peer(piece.peer))

    @staticmethod
    def _give_up(piece: Slice, error: BaseException, *, timeout: bool = False) -> None:
        piece.progress.fail(error, timeout=timeout)
        piece.progress.settle_slice()

    # ----- watchdog ---------------------------------------------------------------------------

    def _start_watchdog(self) -> None:
        with self._lock:
            if self._watchdog is not None or self._closed.is_set():
                return
            self._watchdog = threading.Thread(
                target=self._watch, name="kvflow-transfer-watchdog", daemon=True
            )
            self._watchdog.start()

    def _watch(self) -> None:
        config = self._config
        tick = min(max(min(config.io_timeout_s, config.request_timeout_s) / 4, 0.01), 0.1)
        while not self._closed.wait(tick):
            now = time.monotonic()
            with self._lock:
                live = list(self._live)
            for endpoint in live:
                if not endpoint.busy:
                    continue
                deadline = endpoint.min_deadline()
                if now - endpoint.last_progress > config.io_timeout_s:
                    endpoint.fail(
                        TransferTimeoutError(
                            f"no progress on {endpoint.key} for {config.io_timeout_s}s"
                        )
                    )
                elif deadline is not None and self.context.clock() > deadline:
                    endpoint.fail(
                        TransferTimeoutError(f"request deadline passed on {endpoint.key}")
                    )

    # ----- introspection and shutdown ---------------------------------------------------------

    def endpoint_stats(self) -> dict[EndpointKey, EndpointStats]:
        """Cumulative per-connection counters (a copy of the mapping; the values are live)."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.pool.drain()
        with self._lock:
            live = list(self._live)
        for endpoint in live:
            endpoint.close()
        for endpoint in live:
            endpoint.join()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5.0)
