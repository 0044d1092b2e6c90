"""The transfer half of ``bench.auth``: 1 MiB remote reads with and without the handshake
key, and what TLS would cost on such a connection.

- ``bench_transfer``: a keyed and an open pair of engines (tcp, loopback, no shm), built once
  and warmed; ``reads`` 1 MiB READs per batch, the pairs' batches alternating (the order
  rotating each round), ``repeats`` rounds after a warm-up round. Every batch's bytes are
  checked. Connections are pooled, so the handshake is paid once per connection;
  ``handshake_ms`` is the median cost of a fresh connection's handshake.
- ``bench_tls_socket``: the engine has no TLS (see ``transfer/README.md``); this measures
  what Python's ``ssl`` costs on one loopback connection that streams 1 MiB replies, plain and
  TLS alternating, so the choice has a number.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from kvflow.transfer.handshake import client_handshake

MIB = 1 << 20
KEY = bytes(range(32))


class _Pair:
    """A server engine holding ``reads`` MiB and a client engine reading them back."""

    def __init__(self, secret: bytes | None, reads: int, seed: int) -> None:
        config = TransferConfig(secret=secret, prefer_shm=False)
        self.server, self.client = TransferEngine(config), TransferEngine(config)
        self.data = np.random.default_rng(seed).integers(0, 255, reads * MIB, dtype=np.uint8)
        self.server.register_memory("kv", self.data)
        self.server.start_server("127.0.0.1", 0)
        self.dest = np.zeros(reads * MIB, dtype=np.uint8)
        self.client.register_memory("dest", self.dest)
        target = self.client.open_segment(self.server.peer_address, "kv")
        self.requests = [
            TransferRequest(OpCode.READ, "dest", i * MIB, target, i * MIB, MIB)
            for i in range(reads)
        ]

    def read_batch(self) -> float:
        """One batch of every read; GB/s. RuntimeError when a read failed or is wrong."""
        self.dest[:] = 0
        started = time.perf_counter()
        statuses = self.client.transfer(self.requests, timeout=60)
        elapsed = time.perf_counter() - started
        failed = any(s.state.name != "COMPLETED" for s in statuses)
        if failed or not np.array_equal(self.dest, self.data):
            raise RuntimeError("transfer benchmark: a read failed or returned wrong bytes")
        return len(self.requests) * MIB / elapsed / 1e9

    def close(self) -> None:
        self.client.close()
        self.server.close()


def _rotated(names: list[str], r: int) -> list[str]:
    k = r % len(names)
    return names[k:] + names[:k]


def paired_change(runs: dict[str, list[float]], name: str, base: str) -> float:
    """Median over rounds of ``runs[name][i] / runs[base][i] - 1``."""
    return statistics.median(a / b - 1.0 for a, b in zip(runs[name], runs[base], strict=True))


def _handshake_ms(repeats: int) -> float:
    with TransferEngine(TransferConfig(secret=KEY, prefer_shm=False)) as server:
        server.register_memory("kv", bytearray(4096))
        host, port = server.start_server("127.0.0.1", 0)
        times = []
        for _ in range(repeats):
            with socket.create_connection((host, port), timeout=5) as sock:
                started = time.perf_counter()
                client_handshake(sock, KEY)
                times.append((time.perf_counter() - started) * 1000.0)
        return statistics.median(times)


def bench_transfer(repeats: int, reads: int, seed: int) -> dict[str, Any]:
    pairs = {"secret": _Pair(KEY, reads, seed), "open": _Pair(None, reads, seed)}
    runs: dict[str, list[float]] = {name: [] for name in pairs}
    try:
        for r in range(repeats + 1):
            for name in _rotated(list(pairs), r):
                gbps = pairs[name].read_batch()
                if r:  # the first round is a warm-up (connections, page faults)
                    runs[name].append(gbps)
    finally:
        for pair in pairs.values():
            pair.close()
    return {
        "runs_gbps": runs,
        "secret_gbps": statistics.median(runs["secret"]),
        "open_gbps": statistics.median(runs["open"]),
        "secret_paired_change": paired_change(runs, "secret", "open"),
        "handshake_ms": _handshake_ms(20),
    }


# --- what TLS would cost on a transfer connection -----------------------------------------


@contextlib.contextmanager
def _stream_server(context: ssl.SSLContext | None, payload: bytes) -> Iterator[tuple[str, int]]:
    """A one-connection server: for every 4-byte count N it receives, it sends N payloads."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()[:2]

    def serve() -> None:
        conn, _ = listener.accept()
        with contextlib.closing(conn):
            sock = context.wrap_socket(conn, server_side=True) if context else conn
            with contextlib.suppress(OSError):
                while header := sock.recv(4):
                    for _ in range(struct.unpack("!I", header)[0]):
                        sock.sendall(payload)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        listener.close()
        thread.join(timeout=5)


def _read_batches(sock: socket.socket, reads: int, buf: memoryview) -> float:
    started = time.perf_counter()
    sock.sendall(struct.pack("!I", reads))
    for _ in range(reads):
        got = 0
        while got < MIB:
            n = sock.recv_into(buf[got:], MIB - got)
            if n == 0:
                raise ConnectionError("stream server closed")
            got += n
    return reads * MIB / (time.perf_counter() - started) / 1e9


def bench_tls_socket(cert: Path, key: Path, ca: Path, repeats: int, reads: int) -> dict[str, Any]:
    """Plain vs TLS, one connection each, batches of ``reads`` 1 MiB replies alternating."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(ca))
    payload = np.random.default_rng(0).integers(0, 255, MIB, dtype=np.uint8).tobytes()
    buf = memoryview(bytearray(MIB))
    runs: dict[str, list[float]] = {"tls": [], "plain": []}
    with (
        _stream_server(server_ctx, payload) as tls_at,
        _stream_server(None, payload) as plain_at,
        socket.create_connection(plain_at) as plain,
        client_ctx.wrap_socket(
            socket.create_connection(tls_at), server_hostname="127.0.0.1"
        ) as tls,
    ):
        socks = {"tls": tls, "plain": plain}
        cipher = tls.cipher()
        for r in range(repeats + 1):
            for name in _rotated(list(socks), r):
                gbps = _read_batches(socks[name], reads, buf)
                if r:
                    runs[name].append(gbps)
    return {
        "runs_gbps": runs,
        "tls_gbps": statistics.median(runs["tls"]),
        "plain_gbps": statistics.median(runs["plain"]),
        "tls_paired_change": paired_change(runs, "tls", "plain"),
        "cipher": cipher[0] if cipher else "",
    }
