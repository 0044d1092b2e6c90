"""pysyncobj's TCP transport with a gate before authentication.

pysyncobj reads whatever a connection sends into one growing buffer until a frame (a 4-byte
length, then that many bytes) is whole, and only then checks the frame's Fernet token
(HMAC) before it unzips and unpickles it. A stranger could therefore make a replica buffer
a frame as long as it likes (84 MiB sent cost a replica 125-150 MB) and keep the connection
open by trickling bytes. The gate sits between the socket and pysyncobj until the peer has
proven the password:

* an accepted connection may send at most ``HANDSHAKE_FRAMES`` (2) frames of at most
  ``MAX_HANDSHAKE_FRAME`` bytes each — pysyncobj's key exchange (the peer's random key, then
  its node address sealed with our fresh key). A longer declared frame, a third frame, or
  a second frame that did not authenticate closes the connection;
* a connection we opened may receive one such frame (the peer's reply, sealed with our key);
* a connection not authenticated within ``HANDSHAKE_DEADLINE_S`` is closed, and at most
  ``MAX_PENDING`` accepted connections wait for authentication (the oldest is closed first);
* with no password at all nothing is accepted.

So before authentication at most a few KiB per connection is buffered, and only bytes that
passed the HMAC are ever unzipped or unpickled. After it, pysyncobj reads as before.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import time
from typing import Any

from pysyncobj.tcp_connection import TcpConnection
from pysyncobj.transport import TCPTransport

from kvflow.replication.journal_repair import VoteHold

logger = logging.getLogger(__name__)

HANDSHAKE_FRAMES = 2
MAX_HANDSHAKE_FRAME = 1024
HANDSHAKE_DEADLINE_S = 3.0
MAX_PENDING = 32

_LENGTH = struct.Struct("i")  # pysyncobj's frame header (native int)
_SOCKET_ATTR = "_TcpConnection__socket"  # pysyncobj 0.3.x keeps the socket here


class GatedSocket:
    """A socket whose ``recv`` enforces the handshake budget until :meth:`open` is called.
    After each whole frame one ``recv`` answers EAGAIN, so pysyncobj parses that frame (and
    the transport decides) before another byte is read."""

    def __init__(self, sock: socket.socket, frames: int) -> None:
        self._sock = sock
        self._frames_left = frames
        self._opened = False
        self._refused = False
        self._header = b""
        self._body_left = 0
        self._pause = False
        self.started = time.monotonic()

    @property
    def opened(self) -> bool:
        return self._opened

    def open(self) -> None:
        self._opened = True

    def recv(self, size: int) -> bytes:
        if self._opened:
            return self._sock.recv(size)
        if self._pause:
            self._pause = False
            raise BlockingIOError(errno.EAGAIN, "kvflow raft gate: parse the frame first")
        if self._refused or self._frames_left <= 0:
            return b""  # pysyncobj takes it as the peer closing, and disconnects
        if time.monotonic() - self.started > HANDSHAKE_DEADLINE_S:
            return b""
        want = self._body_left or (_LENGTH.size - len(self._header))
        data = self._sock.recv(min(size, want))
        if not data:
            return data
        if self._body_left:
            self._body_left -= len(data)
            if not self._body_left:
                self._frame_done()
            return data
        self._header += data
        if len(self._header) == _LENGTH.size:
            (length,) = _LENGTH.unpack(self._header)
            self._header = b""
            if not 0 < length <= MAX_HANDSHAKE_FRAME:
                self._refused = True
                return b""
            self._body_left = length
        return data

    def _frame_done(self) -> None:
        self._frames_left -= 1
        self._pause = True

    def __getattr__(self, name: str) -> Any:  # fileno, send, getsockopt, close, ...
        return getattr(self._sock, name)


def _gate(conn: TcpConnection, frames: int) -> GatedSocket | None:
    sock = getattr(conn, _SOCKET_ATTR, None)
    if sock is None:
        return None
    gated = GatedSocket(sock, frames)
    setattr(conn, _SOCKET_ATTR, gated)
    return gated


class GatedTransport(TCPTransport):  # type: ignore[misc]
    """``TCPTransport`` with the module's gate on every connection (pass it to ``SyncObj``
    as ``transportClass``)."""

    def __init__(
        self, syncObj: Any, selfNode: Any, otherNodes: Any, vote_hold: VoteHold | None = None
    ) -> None:
        self._pending: dict[TcpConnection, GatedSocket] = {}
        self._vote_hold = vote_hold
        super().__init__(syncObj, selfNode, otherNodes)

    def _onMessageReceived(self, node: Any, message: Any) -> None:
        if self._vote_hold is not None and self._vote_hold.withholds(message):
            return  # an emptied replica does not vote until it caught up (journal_repair)
        super()._onMessageReceived(node, message)

    def _onNewIncomingConnection(self, conn: TcpConnection) -> None:
        if not self._syncObj.encryptor:
            conn.disconnect()
            return
        gated = _gate(conn, HANDSHAKE_FRAMES)
        if gated is None:
            conn.disconnect()
            return
        while len(self._pending) >= MAX_PENDING:
            oldest = min(self._pending, key=lambda c: self._pending[c].started)
            self._drop(oldest)
        self._pending[conn] = gated
        super()._onNewIncomingConnection(conn)

    def _onIncomingMessageReceived(self, conn: TcpConnection, message: Any) -> None:
        super()._onIncomingMessageReceived(conn, message)
        gated = self._pending.get(conn)
        if gated is not None and conn not in self._unknownConnections and conn.sendRandKey:
            # Associated with a node after a frame sealed with our fresh key: authenticated.
            gated.open()
            del self._pending[conn]

    def _onOutgoingConnected(self, conn: TcpConnection) -> None:
        if self._syncObj.encryptor:
            gated = _gate(conn, 1)
            if gated is None:  # not the pysyncobj this gate knows: fail closed
                conn.disconnect()
                return
            self._pending[conn] = gated
        super()._onOutgoingConnected(conn)

    def _onOutgoingMessageReceived(self, conn: TcpConnection, message: Any) -> None:
        super()._onOutgoingMessageReceived(conn, message)
        gated = self._pending.pop(conn, None)
        if gated is not None:
            gated.open()  # the reply was sealed with the key we just sent: authenticated

    def _onDisconnected(self, conn: TcpConnection) -> None:
        self._pending.pop(conn, None)
        super()._onDisconnected(conn)

    def _onTick(self) -> None:
        super()._onTick()
        now = time.monotonic()
        for conn, gated in list(self._pending.items()):
            if now - gated.started > HANDSHAKE_DEADLINE_S:
                self._drop(conn)

    def _drop(self, conn: TcpConnection) -> None:
        self._pending.pop(conn, None)
        conn.disconnect()
        self._unknownConnections.discard(conn)
