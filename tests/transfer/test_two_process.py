"""tcp between two processes: the server runs in a child Python process."""

from __future__ import annotations

import numpy as np

from .conftest import EngineFactory
from .helpers import random_bytes, read, start_peer, write

SIZE = 6 << 20


def test_read_and_write_across_processes(
    make_engine: EngineFactory, rng: np.random.Generator
) -> None:
    child, address = start_peer(SIZE, 99)
    try:
        expected = np.random.default_rng(99).integers(0, 256, size=SIZE, dtype=np.uint8)
        client = make_engine(prefer_shm=False, slice_size=256 << 10)
        local = np.zeros(SIZE, dtype=np.uint8)
        client.register_memory("local", local)
        target = client.open_segment(address, "remote")
        values = [read("local", i << 20, target, (5 - i) << 20, 1 << 20) for i in range(6)]
        assert all(s.ok for s in client.transfer(values, timeout=20))
        for i in range(6):
            assert np.array_equal(
                local[i << 20 : (i + 1) << 20], expected[(5 - i) << 20 : (6 - i) << 20]
            )
        local[: 1 << 20] = random_bytes(rng, 1 << 20)
        sent = local[: 1 << 20].copy()
        assert client.transfer([write("local", 0, target, 12345, 1 << 20)], timeout=20)[0].ok
        local[:] = 0
        assert client.transfer([read("local", 0, target, 12345, 1 << 20)], timeout=20)[0].ok
        assert np.array_equal(local[: 1 << 20], sent)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        assert child.wait(timeout=20) == 0
        if child.stdout is not None:
            child.stdout.close()
