"""Child processes of the durability tests (started with multiprocessing's spawn): Mooncake-API
members that hold values, and writers that put seeded values with ``replica_num`` and report
each attempt and each acknowledgement to the parent over a pipe.

Values are a pure function of (seed, key), so the parent can check any key it was told about.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvflow.integrations.mooncake import MooncakeDistributedStore, ReplicateConfig

HEARTBEAT_S = 0.3
DEAD_AFTER_S = 1.5


def member_config(meta: str, node_id: str, holds: bool) -> dict[str, Any]:
    """A Mooncake config dict for a member of the test cluster: a holder with 64 MiB of DRAM,
    or a client that holds nothing (like a Mooncake client that mounts no segment)."""
    return {
        "local_hostname": "127.0.0.1",
        "metadata_server": meta,
        "global_segment_size": (64 << 20) if holds else 0,
        "protocol": "tcp",
        "kvflow_node_id": node_id,
        "kvflow_dram_bytes": (64 << 20) if holds else 0,  # explicit: whatever setup derives
        "kvflow_ssd_bytes": 0,
        "kvflow_engine": "memory",
        "kvflow_heartbeat_s": HEARTBEAT_S,
        "kvflow_peer_dead_after_s": DEAD_AFTER_S,
    }


def value_of(seed: int, key: str, min_bytes: int = 1 << 10, max_bytes: int = 64 << 10) -> bytes:
    """The value written under ``key``: 1 KiB - 64 KiB of seeded bytes."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    n = int(rng.integers(min_bytes, max_bytes + 1))
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def holder(meta: str, node_id: str, conn: Connection) -> None:
    """A member that holds copies until the parent closes the pipe (or SIGKILLs it)."""
    logging.basicConfig(level=logging.WARNING)
    store = MooncakeDistributedStore()
    code = store.setup(member_config(meta, node_id, holds=True))
    conn.send(("ready", node_id, code))
    with contextlib.suppress(EOFError):
        conn.recv()  # EOF or any message: stop
    store.close()


def writer(
    meta: str,
    node_id: str,
    seed: int,
    prefix: str,
    n: int,
    replicas: int,
    holds: bool,
    conn: Connection,
) -> None:
    """Put ``n`` values named ``<prefix><i>`` with ``replica_num=replicas``; sends ("try", key)
    before each put and ("ack", key) / ("fail", key, code) after it, then ("done",)."""
    logging.basicConfig(level=logging.ERROR)
    store = MooncakeDistributedStore()
    code = store.setup(member_config(meta, node_id, holds=holds))
    conn.send(("ready", node_id, code))
    config = ReplicateConfig()  # Mooncake's class: fields are set, not passed
    config.replica_num = replicas
    for i in range(n):
        key = f"{prefix}{i}"
        conn.send(("try", key))
        code = store.put(key, value_of(seed, key), config)
        conn.send(("ack", key) if code == 0 else ("fail", key, code))
    conn.send(("done",))
    with contextlib.suppress(EOFError):
        conn.recv()
    store.close()
