"""The engine's glibc malloc settings (allocator.py): a large tensor freed and allocated again
reuses mapped pages instead of faulting fresh ones in; the opt-outs keep glibc's defaults.

Each case runs in a fresh interpreter: the settings are process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from kvflow.stages.engine.allocator import malloc_choice

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# Allocate and touch a 40 MiB tensor (above glibc's largest dynamic mmap threshold, 32 MiB)
# and a 1 MiB one, free both, six times: minor page faults of the last four rounds.
_PROBE = """
import json, resource, sys, torch
from kvflow.stages.engine.allocator import tune_malloc
applied = tune_malloc() if sys.argv[1] == "tune" else None
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = torch.empty(10 << 20).fill_(1.0)
    b = torch.empty(1 << 18).fill_(1.0)
    del a, b
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "again": tune_malloc(), "faults": faults[2:]}))
"""


# Tensors allocated on a thread other than the first (as the engine worker's forward), then
# the number of glibc malloc arenas (malloc_info's heaps).
_ARENAS = """
import ctypes, json, sys, tempfile, threading, torch
from kvflow.stages.engine.allocator import tune_malloc
applied = tune_malloc() if sys.argv[1] == "tune" else None
kept = []
worker = threading.Thread(target=lambda: kept.extend(torch.ones(1 << 18) for _ in range(4)))
worker.start()
worker.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    stream = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    arenas = open(f.name).read().count("<heap nr=")
print(json.dumps({"applied": applied, "arenas": arenas}))
"""


def _probe(mode: str, code: str = _PROBE, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "KVFLOW_MALLOC"))}
    out = subprocess.run(
        [sys.executable, "-c", code, mode],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_tuned_process_reuses_pages_of_freed_tensors() -> None:
    tuned = _probe("tune")
    assert tuned["applied"] is True and tuned["again"] is True
    # 40 MiB is 10,240 pages; reused heap memory faults none of them in again. Most rounds,
    # not every one: a small allocation of another thread that lands in the freed space can
    # make one round extend the heap (seen once beside two busy processes: [10240, 0]).
    assert sorted(tuned["faults"])[1] < 500, tuned


@glibc
def test_tuned_process_allocates_in_one_arena() -> None:
    """A worker thread's tensors come from the main arena, whose freed memory the trim
    threshold keeps; with the operator's MALLOC_ARENA_MAX the thread gets an arena of its
    own (glibc's default)."""
    assert _probe("tune", _ARENAS) == {"applied": True, "arenas": 1}
    assert _probe("tune", _ARENAS, MALLOC_ARENA_MAX="8")["arenas"] > 1


@pytest.mark.slow  # two interpreters with torch: ~8 s on a loaded 2-core machine
@glibc
def test_glibc_defaults_fault_every_round_and_opt_outs_keep_them() -> None:
    system = _probe("tune", KVFLOW_MALLOC="system")
    assert system["applied"] is False
    assert min(system["faults"]) > 5_000, system  # munmap'd and mapped afresh each round
    operator = _probe("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert operator["applied"] is False


def test_bad_choice_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="KVFLOW_MALLOC must be one of"):
        malloc_choice()
