"""A transfer engine in its own process, for the two-process test and nothing else.

Run as ``python -m tests.transfer.peer_process SIZE SEED [shared]``: registers SIZE seeded random
bytes as segment "remote", serves it on 127.0.0.1, prints ``READY <host:port>`` and exits when
stdin closes. With ``shared`` the bytes are a shared pool that peers may only read (what the
kvdb DRAM tier registers), which same-host peers map through the engine's shm socket.
"""

from __future__ import annotations

import sys

import numpy as np

from kvflow.transfer import TransferConfig, TransferEngine
from kvflow.transfer.pool_memory import pool_bytes


def main() -> int:
    size, seed = int(sys.argv[1]), int(sys.argv[2])
    data = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
    shared = sys.argv[3:] == ["shared"]
    with TransferEngine(TransferConfig(prefer_shm=False)) as engine:
        if shared:
            pool = pool_bytes(size, shared=True)
            pool[:] = data
            engine.register_memory("remote", pool, peer_writable=False)
        else:
            engine.register_memory("remote", data)
        engine.start_server()
        sys.stdout.write(f"READY {engine.peer_address}\n")
        sys.stdout.flush()
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
