"""The memory this machine has available now (Linux's MemAvailable): what the server's memory
plan (stages/serve/memory.py) and the engine's default linear backend (onednn_linear.py) size
themselves by."""

from __future__ import annotations

import functools


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@functools.cache
def available_at_start() -> int | None:
    """`available_memory_bytes` as first read in this process (before any engine loaded):
    what the memory plan and every engine's default linear backend decide by, so the line
    the server prints and what its engines do agree however many engines load after it."""
    return available_memory_bytes()
