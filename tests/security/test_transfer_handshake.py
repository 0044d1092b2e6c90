"""The transfer engine's handshake: without the key no byte of a segment moves, either way."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvflow.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from kvflow.transfer.protocol import REQUEST, Op

KEY = b"k" * 32
PATTERN = bytes(range(256)) * 16  # 4 KiB nobody else has


@pytest.fixture
def server() -> Iterator[TransferEngine]:
    engine = TransferEngine(TransferConfig(secret=KEY, prefer_shm=False, connect_timeout_s=0.5))
    engine.register_memory("kv", bytearray(PATTERN))
    engine.start_server("127.0.0.1", 0)
    try:
        yield engine
    finally:
        engine.close()


def read(server: TransferEngine, secret: bytes | None) -> tuple[str, bytes]:
    config = TransferConfig(
        secret=secret, prefer_shm=False, connect_timeout_s=0.5, request_timeout_s=3.0
    )
    with TransferEngine(config) as client:
        dest = bytearray(len(PATTERN))
        client.register_memory("dest", dest)
        try:
            target = client.open_segment(server.peer_address, "kv")
        except Exception as exc:  # no path answered: the handshake failed
            return type(exc).__name__, bytes(dest)
        [status] = client.transfer(
            [TransferRequest(OpCode.READ, "dest", 0, target, 0, len(PATTERN))], timeout=5.0
        )
        return status.state.name, bytes(dest)


def test_the_right_key_reads(server: TransferEngine) -> None:
    state, data = read(server, KEY)
    assert state == "COMPLETED" and data == PATTERN


@pytest.mark.parametrize("secret", [None, b"w" * 32])
def test_no_or_a_wrong_key_reads_nothing(server: TransferEngine, secret: bytes | None) -> None:
    state, data = read(server, secret)
    assert state != "COMPLETED"
    assert data == bytes(len(PATTERN))


def test_a_raw_read_request_gets_only_the_challenge(server: TransferEngine) -> None:
    """Fails on the old code: the server answered a READ from anyone with the segment."""
    host, _, port = server.peer_address.rpartition(":")
    header = REQUEST.pack(Op.READ, 0, 0, 1, 1, 0, len(PATTERN))
    received = b""
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        # A guessed segment id 1..3, with padding so a 64-byte handshake read completes.
        sock.sendall(header * 2)
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            received += chunk
    assert PATTERN[:64] not in received
    assert received.startswith(b"KVFH1") and len(received) == 5 + 32
    assert server.server((host, int(port))).stats.unauthenticated == 1
