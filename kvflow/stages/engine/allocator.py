"""glibc malloc settings for a process that runs a CPU engine: freed activations stay mapped.

A forward pass allocates and frees tensors of megabytes (a 512-token chunk's MLP activations
are ~3-6 MB each) hundreds of times. glibc serves an allocation above its mmap threshold
(128 KiB at start, raised to the largest freed mapped chunk, at most 32 MiB) with fresh pages
from ``mmap`` and gives them back with ``munmap``, and it trims free memory at the top of a
heap beyond twice that threshold. Each such tensor's pages are then faulted in and zeroed
by the kernel again on the next op: up to ~90k minor faults and 0.26 s of system time per
512-token prefill, ~360k and 1.1 s per 2,000 tokens, on the 2-core development machine
(docs/performance.md). A fixed, larger threshold (which also turns off glibc's dynamic one)
keeps those tensors in the heap, where the next pass reuses the same, already mapped pages.

**One arena.** The threshold and the trim keep memory only in glibc's main arena. A thread
other than the first gets an arena of its own, made of heaps of at most 64 MiB, and a heap
whose memory is all free again is unmapped whatever the trim threshold: the engine's forward
runs on its worker thread, so a step whose activations outgrew the current heap (a chunk of
four prompts, rows not a multiple of the last step's) mapped a new heap per layer and faulted
it in: ~90k minor faults in one 1,028-token step on the 2-core development machine, the step
1.6 s instead of 0.74 s beside an idle vLLM, where each fault cost ~2.7x (docs/performance.md,
"One malloc arena"). ``M_ARENA_MAX`` 1 puts every thread's allocations in the main arena;
the serving roles set it before they start any thread. Python's small objects do not go
through malloc's arenas (pymalloc), torch's tensors do, a few per op.

What it costs: up to `TRIM_THRESHOLD` bytes of freed memory stay with the process
instead of returning to the system between requests; threads that allocate at once take
turns at one arena's lock. `KVFLOW_MALLOC=system` keeps glibc's
defaults; so do ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` in the environment
(the operator decided), and an allocator other than glibc's (there ``mallopt`` is absent or
does nothing); ``MALLOC_ARENA_MAX`` in the environment keeps the operator's arena count.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import threading

log = logging.getLogger(__name__)

ENV_MALLOC = "KVFLOW_MALLOC"
MALLOC_CHOICES = ("tuned", "system")
MMAP_THRESHOLD = 64 << 20
"""Allocations below this come from the heap (a 4,096-row chunk's largest activation, 48 MiB
for SmolLM2-135M's MLP, fits)."""
TRIM_THRESHOLD = 128 << 20
"""Free memory at the top of a heap beyond this is returned to the system."""
_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
ARENA_MAX = 1
_OPERATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_lock = threading.Lock()
_applied: bool | None = None


def malloc_choice() -> str:
    """`KVFLOW_MALLOC` (default "tuned"); a value not in `MALLOC_CHOICES` is an error."""
    value = os.environ.get(ENV_MALLOC, "tuned")
    if value not in MALLOC_CHOICES:
        raise ValueError(f"{ENV_MALLOC} must be one of {MALLOC_CHOICES}, got {value!r}")
    return value


def tune_malloc() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once; later calls return the
    first call's answer). True where they were set; False where the choice, the environment
    or the C library leaves glibc's defaults."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if malloc_choice() == "system" or any(name in os.environ for name in _OPERATOR_ENV):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        log.info("malloc: glibc refused an mmap threshold of %d; defaults kept", MMAP_THRESHOLD)
        return False
    if not mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        log.info("malloc: glibc refused a trim threshold of %d bytes", TRIM_THRESHOLD)
    if "MALLOC_ARENA_MAX" not in os.environ and not mallopt(_M_ARENA_MAX, ARENA_MAX):
        log.info("malloc: glibc refused an arena count of %d", ARENA_MAX)
    log.debug("malloc: mmap threshold %d, trim threshold %d", MMAP_THRESHOLD, TRIM_THRESHOLD)
    return True
