"""How many intra-op threads torch uses in a process that runs engines: one place decides.

``torch.set_num_threads`` sets the count that threads start from (and the calling thread's
own); each engine's forward pass runs on its own worker thread, started after this is
applied, with that many OpenMP threads. A process with E engines that are busy at once
therefore runs E x threads compute threads on its cores.

The policy (measured on a 2-core machine with the embedded server's prefill + decode pair;
docs/performance.md, "Threads"): give each engine an equal share of the cores,
``max(1, cores // engines)``, so that busy engines never oversubscribe the cores. A process
with one engine (a node) keeps every core. ``OMP_NUM_THREADS`` or ``KVFLOW_INTRA_OP_THREADS``
in the environment overrides the policy (the operator decided).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV_OVERRIDE = "KVFLOW_INTRA_OP_THREADS"


def cores() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def intra_op_threads(engines: int, ncores: int) -> int:
    """The policy: each of `engines` busy engines gets an equal share of `ncores`."""
    if engines < 1 or ncores < 1:
        raise ValueError(f"engines and cores must be >= 1, got {engines} and {ncores}")
    return max(1, ncores // engines)


def _override() -> int | None:
    raw = os.environ.get(ENV_OVERRIDE)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ENV_OVERRIDE} must be a positive integer, got {raw!r}")
    return int(raw)


def apply_intra_op_threads(engines: int) -> int:
    """Set torch's intra-op thread count for a process about to run `engines` engines; returns
    the count before, for the caller to restore when its engines stop. Leaves torch's count
    alone when OMP_NUM_THREADS is set (torch already follows it); KVFLOW_INTRA_OP_THREADS sets
    the count outright."""
    before = torch.get_num_threads()
    override = _override()
    if override is None and "OMP_NUM_THREADS" in os.environ:
        logger.info("intra-op threads: %d (OMP_NUM_THREADS)", before)
        return before
    n = override or intra_op_threads(engines, cores())
    torch.set_num_threads(n)
    logger.info("intra-op threads: %d for %d engine(s) on %d core(s)", n, engines, cores())
    return before
