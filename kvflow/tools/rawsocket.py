"""The raw-socket baseline of the transfer benchmarks: a plain recv_into loop."""

from __future__ import annotations

import socket
import time


def timed_request(sock: socket.socket, request: bytes, buf: memoryview) -> float:
    """Send ``request``, receive exactly ``buf.nbytes`` into ``buf``; returns GB/s."""
    start = time.perf_counter()
    sock.sendall(request)
    got, total = 0, buf.nbytes
    while got < total:
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("raw server closed")
        got += n
    return total / (time.perf_counter() - start) / 1e9
