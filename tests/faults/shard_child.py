"""A kvdb shard in a process of its own, for the data-dir damage tests (a SIGBUS must show as
the child's signal, not kill the test):

    python -m tests.faults.shard_child ENGINE DATA_DIR fill|read|hold

``fill`` stores BLOCKS seeded blocks and closes (they end on the SSD tier); ``read`` opens the
shard and prints one JSON line {"present": n, "wrong": n}; ``hold`` opens it, prints
"holding", and keeps it open until stdin closes. A shard that cannot open prints the error
on one line (stderr) and exits 1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import numpy as np

from kvflow.kvdb import Shard
from kvflow.kvdb.config import StoreConfig
from kvflow.kvdb.errors import KVDBError

BLOCKS = 64
NBYTES = 4096
FINGERPRINT = "faults-shard-child"


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=16).digest()


def value(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, NBYTES, dtype=np.uint8).tobytes()


def config(engine: str, data_dir: Path) -> StoreConfig:
    return StoreConfig(
        data_dir=data_dir,
        engine=engine,
        dram_capacity_bytes=4 * NBYTES,
        ssd_capacity_bytes=4 * BLOCKS * NBYTES,
        lmdb_map_size_bytes=64 << 20,
    )


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    engine, data_dir, action = argv[0], Path(argv[1]), argv[2]
    try:
        shard = Shard(config(engine, data_dir), FINGERPRINT)
    except KVDBError as exc:
        print(f"shard_child: {exc}", file=sys.stderr)
        return 1
    try:
        if action == "fill":
            for i in range(BLOCKS):
                shard.put(key(i), value(i))
        elif action == "read":
            present = wrong = 0
            for i in range(BLOCKS):
                got = shard.get(key(i))
                if got is not None:
                    present += 1
                    wrong += got != value(i)
            print(json.dumps({"present": present, "wrong": wrong}), flush=True)
        elif action == "hold":
            print("holding", flush=True)
            sys.stdin.read()
    finally:
        shard.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
