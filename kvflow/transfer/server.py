"""TcpServer: serves one engine's registered segments to peers over the tcp wire protocol.

One accept thread plus one thread per connection (at most ``max_server_connections``), each
authenticated by the handshake of ``handshake.py`` before its first request when the engine
has a secret; each connection's requests are answered in
order (which lets clients pipeline). READ data is sent straight from the segment's memory and
WRITE data is received straight into it. A bad request (unknown segment, out of bounds) gets an
error response and the connection keeps serving; only a malformed stream closes it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from dataclasses import dataclass

from kvflow.transfer.config import TransferConfig
from kvflow.transfer.errors import (
    HandshakeError,
    OutOfBoundsError,
    ProtocolError,
    UnknownSegmentError,
)
from kvflow.transfer.handshake import server_handshake
from kvflow.transfer.memory import SegmentTable
from kvflow.transfer.protocol import (
    MAX_CONTROL_PAYLOAD,
    REQUEST,
    RESPONSE,
    Op,
    SegmentDescription,
    Status,
    discard,
    recv_exact,
    recv_exact_into,
    send_parts,
    tune_socket,
)
from kvflow.transfer.shared import host_id

logger = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.1


@dataclass
class ServerStats:
    """Counters of one server; read them, they are not reset."""

    connections: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    refused: int = 0
    unauthenticated: int = 0


class TcpServer:
    """Listens on ``host:port`` (port 0 picks one) for the segments in ``segments``.

    start() binds and returns the bound address; stop() closes the listener and every connection
    and joins all threads. Thread-safe; stop() is idempotent.
    """

    def __init__(self, segments: SegmentTable, config: TransferConfig) -> None:
        self._segments = segments
        self._config = config
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.stats = ServerStats()
        self.address: tuple[str, int] | None = None

    def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
            listener.listen(self._config.server_backlog)
        except OSError:
            listener.close()
            raise
        listener.settimeout(_ACCEPT_POLL_S)
        self._listener = listener
        bound_host, bound_port = listener.getsockname()[:2]
        self.address = (bound_host, int(bound_port))
        thread = threading.Thread(
            target=self._accept_loop, name=f"kvflow-transfer-accept-{bound_port}", daemon=True
        )
        self._threads.append(thread)
        thread.start()
        logger.info("transfer server listening on %s:%d", bound_host, bound_port)
        return self.address

    def stop(self) -> None:
        """Close the listener and all connections (in-flight peers see a dropped link)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _shutdown(conn)
        for thread in list(self._threads):
            thread.join(timeout=5.0)
        if self._listener is not None:
            self._listener.close()
        logger.info("transfer server %s stopped", self.address)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            conn.settimeout(None)
            tune_socket(conn, self._config.socket_buffer_bytes)
            with self._lock:
                if self._stopped.is_set():
                    conn.close()
                    break
                if len(self._conns) >= self._config.max_server_connections:
                    self.stats.refused += 1
                    logger.warning("transfer server full: refusing a connection from %s", peer)
                    conn.close()
                    continue
                self._conns.add(conn)
                self.stats.connections += 1
                thread = threading.Thread(
                    target=self._serve, args=(conn, peer), name="kvflow-transfer-conn", daemon=True
                )
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        header = bytearray(REQUEST.size)
        header_view = memoryview(header)
        scratch = memoryview(bytearray(1 << 16))
        try:
            if self._config.secret is not None:
                try:
                    server_handshake(conn, self._config.secret, self._config.connect_timeout_s)
                except (HandshakeError, OSError) as exc:
                    self.stats.unauthenticated += 1
                    logger.warning("transfer connection from %s refused: %s", peer, exc)
                    return
            while True:
                recv_exact_into(conn, header_view)
                op, _flags, _res, segment_id, request_id, offset, length = REQUEST.unpack(header)
                if op == Op.READ:
                    self._read(conn, segment_id, request_id, offset, length)
                elif op == Op.WRITE:
                    self._write(conn, segment_id, request_id, offset, length, scratch)
                elif op == Op.DESCRIBE:
                    self._describe(conn, request_id, length)
                else:
                    raise ProtocolError(f"unknown op {op}")
        except (ConnectionError, OSError) as exc:
            logger.debug("transfer connection from %s ended: %s", peer, exc)
        except ProtocolError as exc:
            logger.warning("closing transfer connection from %s: %s", peer, exc)
            self._reply_error(conn, 0, Status.BAD_REQUEST, str(exc), quiet=True)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _read(
        self, conn: socket.socket, segment_id: int, request_id: int, offset: int, length: int
    ) -> None:
        try:
            window = self._segments.by_id(segment_id).window(offset, length)
        except (UnknownSegmentError, OutOfBoundsError) as exc:
            self._reply_error(conn, request_id, _status_of(exc), str(exc))
            return
        with window:
            send_parts(conn, (RESPONSE.pack(Status.OK, 0, request_id, length), window))
        self.stats.bytes_read += length

    def _write(
        self,
        conn: socket.socket,
        segment_id: int,
        request_id: int,
        offset: int,
        length: int,
        scratch: memoryview,
    ) -> None:
        try:
            segment = self._segments.by_id(segment_id)
            window = segment.window(offset, length)
        except (UnknownSegmentError, OutOfBoundsError) as exc:
            discard(conn, length, scratch)
            self._reply_error(conn, request_id, _status_of(exc), str(exc))
            return
        if not segment.peer_writable:
            discard(conn, length, scratch)
            message = f"segment {segment.name!r} is read-only for peers"
            self._reply_error(conn, request_id, Status.READ_ONLY, message)
            return
        with window:
            recv_exact_into(conn, window)
        self.stats.bytes_written += length
        conn.sendall(RESPONSE.pack(Status.OK, 0, request_id, 0))

    def _describe(self, conn: socket.socket, request_id: int, length: int) -> None:
        if length > MAX_CONTROL_PAYLOAD:
            raise ProtocolError(f"DESCRIBE name of {length} bytes is too long")
        name = recv_exact(conn, length).decode("utf-8", errors="replace")
        try:
            segment = self._segments.by_name(name)
        except UnknownSegmentError as exc:
            self._reply_error(conn, request_id, Status.UNKNOWN_SEGMENT, str(exc))
            return
        payload = SegmentDescription(
            segment.segment_id,
            segment.size,
            segment.shm_name,
            host_id(),
            self._config.engine_name,
        ).encode()
        send_parts(conn, (RESPONSE.pack(Status.OK, 0, request_id, len(payload)), payload))

    def _reply_error(
        self,
        conn: socket.socket,
        request_id: int,
        status: Status,
        message: str,
        *,
        quiet: bool = False,
    ) -> None:
        self.stats.errors += 1
        if not quiet:
            logger.info("transfer request=%d rejected: %s", request_id, message)
        body = message.encode()[:MAX_CONTROL_PAYLOAD]
        try:
            send_parts(conn, (RESPONSE.pack(status, 0, request_id, len(body)), body))
        except OSError:
            if not quiet:
                raise


def _status_of(exc: Exception) -> Status:
    return Status.UNKNOWN_SEGMENT if isinstance(exc, UnknownSegmentError) else Status.OUT_OF_BOUNDS


def _shutdown(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
