"""How many intra-op threads each engine's forward passes use: one place decides.

Each engine runs its forward passes on its own worker thread (``EngineWorker``), which sets
its own intra-op count (``engine/openmp.py``: the process's other threads default to 1, so
only engine threads build OpenMP teams, and how those wait is decided there). The embedded
server runs a prefill and a decode engine in one process; with torch's default (every
core for every thread) the two, when busy at once, run 2 x cores compute threads.

The policy, measured on a 2-core machine (docs/performance.md, "Threads"):
- a **prefill** engine gets every core (shared equally among prefill engines,
  ``max(1, cores // prefill_engines)``): prefill is compute-bound, and a lone prefill (the
  time to the first token on an idle server) runs 1.8x faster on 2 threads than on 1;
- a **decode** engine gets an equal share of all engines, ``max(1, cores // engines)``:
  decode at small batch is bound by memory bandwidth, which one core of two already draws
  (batch 1 was no slower on 1 thread than on 2), and its share leaves the prefill's cores.

A decode engine's share applies only while a prefill engine of the process is inside a step:
before each of its steps the decode engine checks (``PrefillSteps``, which every prefill
worker of the process marks around its steps) and, while no prefill engine computes, uses
every core (``alone``; a batch-1 decode step ran 1.3x faster on 2 threads than on 1 here,
docs/performance.md). ``KVFLOW_DECODE_THREADS=share`` keeps the share at all times.

A colocated embedded server (``--colocate``) has one engine per prefill/decode pair; it gets
the prefill's share (``engine_threads("prefill", pairs, 0)``): every core for one pair.

``KVFLOW_INTRA_OP_THREADS`` sets every engine's count outright (fixed, no adapting); with
``OMP_NUM_THREADS`` set, engines keep torch's count (the operator decided). A process with
one engine (a node) leaves torch's default: every core.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV_OVERRIDE = "KVFLOW_INTRA_OP_THREADS"
ENV_DECODE = "KVFLOW_DECODE_THREADS"
DECODE_MODES = ("adaptive", "share")
ROLES = ("prefill", "decode")


class PrefillSteps:
    """How many prefill engines of a process are inside a step now. Prefill workers mark
    their steps (``with steps.stepping():``); decode workers read ``busy`` before each step.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0

    @contextmanager
    def stepping(self) -> Iterator[None]:
        with self._lock:
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1

    @property
    def busy(self) -> bool:
        """Whether some prefill engine is inside a step (a plain read: it decides one step's
        thread count, and a step that begins meanwhile is seen at the next one)."""
        return self._inside > 0


@dataclass(frozen=True)
class EngineThreads:
    """One engine's intra-op threads, decided by its worker before each step: ``share``
    while ``watches`` reports a prefill engine inside a step (or always, without
    ``watches``), else ``alone``. ``marks``: the engine is a prefill engine whose steps it
    reports there."""

    share: int
    alone: int | None = None
    watches: PrefillSteps | None = None
    marks: PrefillSteps | None = None

    def __post_init__(self) -> None:
        if self.share < 1 or (self.alone is not None and self.alone < 1):
            raise ValueError(f"thread counts must be >= 1, got {self.share}/{self.alone}")

    def for_step(self) -> int:
        if self.alone is None or self.watches is None or self.watches.busy:
            return self.share
        return self.alone


def cores() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def intra_op_threads(role: str, prefill: int, decode: int, ncores: int) -> int:
    """The policy for an engine of `role` among `prefill` + `decode` engines on `ncores`:
    prefill engines share every core, a decode engine gets its share of all engines'."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if prefill < 0 or decode < 0 or prefill + decode < 1 or ncores < 1:
        raise ValueError(f"need engines and cores >= 1, got {prefill}+{decode} and {ncores}")
    if role == "prefill":
        return max(1, ncores // max(1, prefill))
    return max(1, ncores // (prefill + decode))


def _override() -> int | None:
    raw = os.environ.get(ENV_OVERRIDE)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ENV_OVERRIDE} must be a positive integer, got {raw!r}")
    return int(raw)


def engine_threads(role: str, prefill: int, decode: int) -> int | None:
    """The intra-op threads for an engine of `role` in a process that runs `prefill` +
    `decode` engines on this machine's cores; None: leave torch's (OMP_NUM_THREADS is set)."""
    override = _override()
    if override is not None:
        return override
    if "OMP_NUM_THREADS" in os.environ:
        return None
    n = intra_op_threads(role, prefill, decode, cores())
    logger.info(
        "%s engine: %d intra-op threads (%d+%d engines, %d cores)",
        role,
        n,
        prefill,
        decode,
        cores(),
    )
    return n


def decode_mode() -> str:
    """`KVFLOW_DECODE_THREADS` (default "adaptive"): "share" keeps a decode engine at its
    share of the cores even while no prefill engine computes."""
    value = os.environ.get(ENV_DECODE, "adaptive")
    if value not in DECODE_MODES:
        raise ValueError(f"{ENV_DECODE} must be one of {DECODE_MODES}, got {value!r}")
    return value


def embedded_threads(prefill: int, decode: int, colocate: bool) -> dict[str, EngineThreads | None]:
    """Each role's engine threads in an embedded server of `prefill` + `decode` engines
    (one engine per pair when `colocate`); None: torch's count. While no prefill engine is
    inside a step, decode engines share every core (``decode_mode``), unless the
    environment fixed the counts."""
    if colocate:
        n = engine_threads("prefill", prefill, 0)
        fixed = None if n is None else EngineThreads(n)
        return {role: fixed for role in ROLES}
    counts = {role: engine_threads(role, prefill, decode) for role in ROLES}
    if counts["decode"] is None or counts["prefill"] is None:
        return {role: None for role in ROLES}
    if _override() is not None or decode_mode() == "share":
        return {role: EngineThreads(counts[role] or 1) for role in ROLES}
    alone = max(1, cores() // decode)  # decode engines share the cores a prefill leaves
    if alone <= counts["decode"]:
        return {role: EngineThreads(counts[role] or 1) for role in ROLES}
    steps = PrefillSteps()
    logger.info("decode engine: %d intra-op threads while no prefill engine computes", alone)
    return {
        "prefill": EngineThreads(counts["prefill"], marks=steps),
        "decode": EngineThreads(counts["decode"], alone=alone, watches=steps),
    }
