"""Shared fixtures: free loopback ports and seeded randomness."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import pytest


def pick_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def free_port() -> int:
    return pick_free_port()


@pytest.fixture(autouse=True)
def _seed_everything() -> Iterator[None]:
    random.seed(0)
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    yield
