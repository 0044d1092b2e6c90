"""How many intra-op threads each engine's forward passes use: one place decides.

Each engine runs its forward passes on its own worker thread (``EngineWorker``), and torch's
intra-op count is per thread once set there (``torch.set_num_threads`` called on that
thread; it also becomes the count that threads started later begin with). The embedded
server runs a prefill and a decode engine in one process; with torch's default (every
core for every thread) the two, when busy at once, run 2 x cores compute threads.

The policy, measured on a 2-core machine (docs/performance.md, "Threads"):
- a **prefill** engine gets every core (shared equally among prefill engines,
  ``max(1, cores // prefill_engines)``): prefill is compute-bound, and a lone prefill (the
  time to the first token on an idle server) runs 1.8x faster on 2 threads than on 1;
- a **decode** engine gets an equal share of all engines, ``max(1, cores // engines)``:
  decode at small batch is bound by memory bandwidth, which one core of two already draws
  (batch 1 was no slower on 1 thread than on 2), and its share leaves the prefill's cores.

A colocated embedded server (``--colocate``) has one engine per prefill/decode pair; it gets
the prefill's share (``engine_threads("prefill", pairs, 0)``): every core for one pair.

``KVFLOW_INTRA_OP_THREADS`` sets every engine's count outright; with ``OMP_NUM_THREADS``
set, engines keep torch's count (the operator decided). A process with one engine (a node)
leaves torch's default: every core.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV_OVERRIDE = "KVFLOW_INTRA_OP_THREADS"
ROLES = ("prefill", "decode")


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
