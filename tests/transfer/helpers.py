"""Small helpers shared by the transfer tests."""

from __future__ import annotations

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
