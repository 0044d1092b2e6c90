"""Small helpers shared by the transfer tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from kvflow.transfer import OpCode, SegmentHandle, TransferRequest


def random_bytes(rng: np.random.Generator, size: int) -> np.ndarray:
    return rng.integers(0, 256, size=size, dtype=np.uint8)


def read(
    local: str, local_offset: int, target: SegmentHandle, remote_offset: int, length: int
) -> TransferRequest:
    return TransferRequest(OpCode.READ, local, local_offset, target, remote_offset, length)


def write(
    local: str, local_offset: int, target: SegmentHandle, remote_offset: int, length: int
) -> TransferRequest:
    return TransferRequest(OpCode.WRITE, local, local_offset, target, remote_offset, length)


def start_peer(size: int, seed: int, *mode: str) -> tuple[subprocess.Popen[str], str]:
    """A transfer engine in a child process (``peer_process.py``) and its address, once it
    is ready. Close its stdin to stop it."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.transfer.peer_process", str(size), str(seed), *mode],
        cwd=Path(__file__).resolve().parents[2],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    ready = child.stdout.readline().split()
    if ready[:1] != ["READY"]:
        child.kill()
        child.wait(timeout=20)
        raise AssertionError(f"the peer process did not get ready: {ready}")
    return child, ready[1]
