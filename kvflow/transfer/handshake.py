"""The transfer engine's connection handshake: HMAC challenge-response, both ways, before any
segment byte moves.

    server -> client  MAGIC | server nonce (32)
    client -> server  HMAC(key, "c" | server nonce | client nonce) (32) | client nonce (32)
    server -> client  HMAC(key, "s" | client nonce | server nonce) (32)

The server checks the client's proof before it reads a request; the client checks the
server's before it sends one, so neither side talks to a peer without the key. Fresh nonces on
both sides make a recorded handshake useless. With no key (``TransferConfig.secret`` None)
there is no handshake at all: both sides must agree, a mismatch fails the first exchange.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from kvflow.transfer.errors import HandshakeError
from kvflow.transfer.protocol import recv_exact

MAGIC = b"KVFH1"
NONCE = 32


def _mac(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, role + first + second, hashlib.sha256).digest()


def server_handshake(conn: socket.socket, key: bytes, timeout_s: float) -> None:
    """Authenticate the peer of an accepted connection; HandshakeError (or OSError) when it
    does not prove the key within ``timeout_s``. Restores the socket's blocking mode."""
    previous = conn.gettimeout()
    conn.settimeout(timeout_s)
    try:
        server_nonce = secrets.token_bytes(NONCE)
        conn.sendall(MAGIC + server_nonce)
        reply = recv_exact(conn, 2 * NONCE)
        proof, client_nonce = reply[:NONCE], reply[NONCE:]
        if not hmac.compare_digest(proof, _mac(key, b"c", server_nonce, client_nonce)):
            raise HandshakeError("transfer handshake failed: the peer does not hold the key")
        conn.sendall(_mac(key, b"s", client_nonce, server_nonce))
    finally:
        conn.settimeout(previous)


def client_handshake(conn: socket.socket, key: bytes) -> None:
    """Prove the key to the server just connected to and check its proof (the socket's own
    timeout applies); HandshakeError when the server is not one of ours."""
    hello = recv_exact(conn, len(MAGIC) + NONCE)
    if hello[: len(MAGIC)] != MAGIC:
        raise HandshakeError("transfer handshake failed: the server sent no challenge")
    server_nonce = hello[len(MAGIC) :]
    client_nonce = secrets.token_bytes(NONCE)
    conn.sendall(_mac(key, b"c", server_nonce, client_nonce) + client_nonce)
    proof = recv_exact(conn, NONCE)
    if not hmac.compare_digest(proof, _mac(key, b"s", client_nonce, server_nonce)):
        raise HandshakeError("transfer handshake failed: the server does not hold the key")
