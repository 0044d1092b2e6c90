"""Ports for local processes: the one helper every server, supervisor and test uses."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (tests, local clusters, defaults)."""
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
