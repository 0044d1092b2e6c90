"""Small helpers shared by the group tests."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvflow.replication import MetadataGroup, Tier


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def blocks(start: int, stop: int, tier: Tier = Tier.DRAM) -> list[tuple[bytes, Tier]]:
    return [(key(i), tier) for i in range(start, stop)]


def commit_index(group: MetadataGroup) -> int:
    return int(group.raft_status()["commit_idx"])


def last_log_index(group: MetadataGroup) -> int:
    """The index of the last entry in ``group``'s Raft log (a fresh journal: pysyncobj's log
    starts at index 1 and nothing is compacted within a test)."""
    return int(group.raft_status()["log_len"])


def raft_term(group: MetadataGroup) -> int:
    return int(group.raft_status()["raft_term"])


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 10 ms; fail the test with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
