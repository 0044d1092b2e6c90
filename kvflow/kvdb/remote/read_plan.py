"""How one remote read's blocks become transfer requests: runs, and chunks of runs.

A *run* is a sequence of blocks that lie back to back in the holder's segment AND whose
destinations lie back to back in one local segment: it moves as ONE transfer request (the tcp
backend slices it over its lanes), however many blocks it holds. Blocks put in one batch sit
back to back in the holder's DRAM pool (first-fit allocation), and a reader usually reads them
into consecutive pages of its pool, so a batch of small blocks costs a few requests on both
sides instead of one each. Checksums stay per block: a run only changes how bytes move.

Runs are grouped into *chunks* of about ``chunk_bytes``, each submitted as its own transfer
batch: the reader verifies a chunk's blocks as soon as it has landed, while the later chunks
still move and while its bytes are still in the CPU's cache (a chunk of a quarter of a large
read was verified from memory; measured in BENCHMARKS.md, issue 24 item 5).

Pure functions over positions; nothing here moves bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

RUN_BYTES = 4 << 20
"""A run grows to at most this many bytes (a single larger block is a run of its own)."""
CHUNK_BYTES = 4 << 20
"""A chunk holds runs until it reaches this many bytes."""


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` items from ``first`` (positions in the planned item list), moved as one
    request of ``length`` bytes from ``remote_offset`` into ``local_segment`` at
    ``local_offset``."""

    first: int
    count: int
    local_segment: str
    local_offset: int
    remote_offset: int
    length: int


def plan_runs(items: Sequence[tuple[str, int, int, int]], max_bytes: int = RUN_BYTES) -> list[Run]:
    """Runs over ``items``, in order: each item is (local segment, local offset, remote
    offset, length); an item joins the run before it when both of its offsets continue that
    run's and the run stays within ``max_bytes``."""
    runs: list[Run] = []
    if not items:
        return runs
    segment, local, remote, length = items[0]
    first = count = 0
    for i, (seg, lo, ro, n) in enumerate(items):
        if (
            count
            and seg == segment
            and lo == local + length
            and ro == remote + length
            and length + n <= max_bytes
        ):
            length += n
            count += 1
            continue
        if count:
            runs.append(Run(first, count, segment, local, remote, length))
        segment, local, remote, length = seg, lo, ro, n
        first, count = i, 1
    runs.append(Run(first, count, segment, local, remote, length))
    return runs


def chunk_runs(runs: Sequence[Run], chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges over ``runs``, in order, each of at least ``chunk_bytes`` (the last
    may hold less) and at least one run."""
    chunks: list[tuple[int, int]] = []
    lo = used = 0
    for i, run in enumerate(runs):
        used += run.length
        if used >= chunk_bytes:
            chunks.append((lo, i + 1))
            lo, used = i + 1, 0
    if lo < len(runs):
        chunks.append((lo, len(runs)))
    return chunks


__all__ = ["CHUNK_BYTES", "RUN_BYTES", "Run", "chunk_runs", "plan_runs"]
