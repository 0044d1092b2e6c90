"""A transfer engine in its own process, for the two-process test and nothing else.

Run as ``python -m tests.transfer.peer_process SIZE SEED``: registers SIZE seeded random bytes as
segment "remote", serves it on 127.0.0.1, prints ``READY <host:port>`` and exits when stdin closes.
"""

from __future__ import annotations

import sys

import numpy as np

from kvflow.transfer import TransferConfig, TransferEngine


def main() -> int:
    size, seed = int(sys.argv[1]), int(sys.argv[2])
    data = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
    with TransferEngine(TransferConfig(prefer_shm=False)) as engine:
        engine.register_memory("remote", data)
        engine.start_server()
        sys.stdout.write(f"READY {engine.peer_address}\n")
        sys.stdout.flush()
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
