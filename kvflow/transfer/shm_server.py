"""ShmServer: hands an engine's shared segments to authenticated same-host peers.

It listens on the engine's abstract unix socket (``shared.socket_name``; a name in the network
namespace, no file) and serves the exchange that ``shared.py`` describes. A connection is
served only when its peer runs as this process's user (``SO_PEERCRED``) and, where the engine
has a key, proves it by the transfer handshake, both before any descriptor leaves; a segment
that peers may not write goes out as a read-only descriptor, so the peer cannot map it
writable. One thread per connection (a host has few peers), at most ``MAX_CONNECTIONS``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

from kvflow.transfer.errors import HandshakeError, ProtocolError
from kvflow.transfer.handshake import server_handshake
from kvflow.transfer.memory import LocalSegment
from kvflow.transfer.protocol import recv_exact
from kvflow.transfer.shared import (
    HELLO,
    MAGIC,
    MAX_NAME,
    MAX_REFUSAL,
    OK,
    REPLY,
    REQUEST,
    SLOTS,
    UNKNOWN,
    SlotTable,
    abstract_address,
    peer_uid,
    readonly_fd,
    send_with_fd,
    socket_name,
)

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 64


class ShmServer:
    """Serves the segments ``share``d with it on ``socket_name(engine_name)``. OSError at
    construction when the socket cannot be bound (another engine of that name in this
    network namespace). Thread-safe."""

    def __init__(self, engine_name: str, key: bytes | None, handshake_timeout_s: float) -> None:
        self.name = socket_name(engine_name)
        self._key = key
        self._timeout_s = handshake_timeout_s
        self._lock = threading.Lock()
        self._shared: dict[str, tuple[LocalSegment, int]] = {}
        self._conns: set[socket.socket] = set()
        self._closed = False
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(abstract_address(self.name))
            listener.listen(MAX_CONNECTIONS)
            self._slots = SlotTable()
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, name=f"shm-{engine_name}", daemon=True)
        self._thread.start()

    def share(self, segment: LocalSegment) -> bool:
        """Serve ``segment`` (it has a ``region``); False when every slot is taken."""
        with self._lock:
            slot = self._slots.assign(segment.segment_id)
            if slot is None:
                logger.warning(
                    "segment=%s: all %d shm slots taken; same-host peers read it over tcp",
                    segment.name,
                    SLOTS,
                )
                return False
            self._shared[segment.name] = (segment, slot)
        return True

    def unshare(self, name: str) -> None:
        """Stop serving ``name``; peers' mappings of it fail their next transfer."""
        with self._lock:
            entry = self._shared.pop(name, None)
            if entry is not None:
                self._slots.clear(entry[1])

    def stop(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            self._shared.clear()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5.0)
        self._slots.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                refused = self._closed or len(self._conns) >= MAX_CONNECTIONS
                if not refused:
                    self._conns.add(conn)
            if refused:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._admit(conn)
            with self._lock:
                slots_fd = None if self._closed else readonly_fd(self._slots.fd)
            if slots_fd is None:
                return
            try:
                send_with_fd(conn, HELLO.pack(MAGIC, SLOTS), slots_fd)
            finally:
                os.close(slots_fd)
            while True:
                (length,) = REQUEST.unpack(recv_exact(conn, REQUEST.size))
                if not 0 < length <= MAX_NAME:
                    raise ProtocolError(f"segment name of {length} bytes")
                self._answer(conn, recv_exact(conn, length).decode("utf-8", errors="replace"))
        except (OSError, HandshakeError, ProtocolError) as exc:
            logger.debug("shm connection closed: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _admit(self, conn: socket.socket) -> None:
        uid = peer_uid(conn)
        if uid != os.geteuid():
            logger.warning("shm: refused a connection from a process of uid %d", uid)
            raise HandshakeError(f"peer uid {uid} is not this process's user")
        if self._key is not None:
            server_handshake(conn, self._key, self._timeout_s)

    def _answer(self, conn: socket.socket, name: str) -> None:
        with self._lock:
            entry = self._shared.get(name)
        if entry is None:
            message = f"segment {name!r} is not shared here".encode()[:MAX_REFUSAL]
            conn.sendall(REPLY.pack(UNKNOWN, 0, 0, 0, len(message), 0) + message)
            return
        segment, slot = entry
        assert segment.region is not None
        fd, offset = segment.region
        writable = segment.peer_writable
        given = os.dup(fd) if writable else readonly_fd(fd)
        try:
            reply = REPLY.pack(OK, int(writable), slot, segment.segment_id, segment.size, offset)
            send_with_fd(conn, reply, given)
        finally:
            os.close(given)
