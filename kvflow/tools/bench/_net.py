"""The raw-socket baseline of the transfer benchmarks (a plain recv_into loop), and the stop
of their server process."""

from __future__ import annotations

import socket
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess


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


def stop_server_process(conn: Connection, proc: BaseProcess, timeout_s: float = 30.0) -> None:
    """Tell the benchmark's server process to stop; terminate it if it does not in time."""
    conn.send("stop")
    proc.join(timeout=timeout_s)
    if proc.is_alive():
        proc.terminate()
        proc.join()
