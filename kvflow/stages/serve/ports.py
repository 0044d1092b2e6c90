"""Ports for local processes: the one helper every server, supervisor and test uses."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_SPAN = 8192
"""How many ports below the OS's ephemeral range `free_port` draws from."""
_TRIES = 64
_draw = random.SystemRandom()  # not the seeded global generator: two processes differ


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports the OS gives outgoing connections (Linux's ip_local_port_range; its default
    where the file is missing or unreadable)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (tests, local clusters, defaults).

    Drawn below the OS's ephemeral range where there is room: ports from that range are also
    what outgoing connections get as their source ports, so one picked there can be taken by a
    connection before its server binds it. This was seen when a test cluster's router could
    not bind its port while the suite ran beside other load. Falls back to the OS's choice
    (bind to port 0)."""
    low, _ = ephemeral_range()
    first = max(1024, low - LISTEN_SPAN)
    if low - first >= 1024:
        for _ in range(_TRIES):
            port = _draw.randrange(first, low)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class PortPicker:
    """Free ports for one set of processes that bind later, never the same port twice.

    Each :func:`free_port` is free only when it returns, and the OS may hand the same port out
    again on the next ask: a cluster once gave one port to a metadata replica and to a node,
    and the node could not start. Not thread-safe (one supervisor's constructor uses it)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._host = host
        self._given: set[int] = set()

    def __call__(self) -> int:
        while True:
            port = free_port(self._host)
            if port not in self._given:
                self._given.add(port)
                return port
