"""The load benchmark's per-level cores (`kvflow/tools/bench/_cores.py`): the server's
process tree, the clients, and the other processes, measured from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvflow.tools.bench._cores import CoreMeter, tree_cpu_s

pytestmark = pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs Linux /proc")

# a parent that starts a busy child and waits for it: its own CPU stays near 0
_PARENT = (
    "import subprocess, sys; "
    "subprocess.run([sys.executable, '-c', "
    '\'import time\\nend = time.process_time() + float(__import__("sys").argv[1])\\n'
    "while time.process_time() < end: pass', sys.argv[1]])"
)


def _busy_tree(cpu_s: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _PARENT, str(cpu_s)], start_new_session=True)


def _stop(tree: subprocess.Popen[bytes]) -> None:
    """The parent and its busy child (its own process group)."""
    os.killpg(tree.pid, signal.SIGKILL)
    tree.wait(30)


def test_tree_cpu_counts_the_descendants() -> None:
    parent = _busy_tree(30.0)
    try:
        deadline = time.monotonic() + 120
        used = 0.0
        while time.monotonic() < deadline:  # the child's busy loop shows under its parent
            used = tree_cpu_s(parent.pid) or 0.0
            if used > 0.5:
                break
            time.sleep(0.05)
        assert used > 0.5
    finally:
        _stop(parent)
    assert tree_cpu_s(parent.pid) is None  # gone (reaped)


def test_a_level_splits_its_cores_by_whom() -> None:
    parent = _busy_tree(30.0)
    try:
        meter = CoreMeter(parent.pid)
        deadline = time.monotonic() + 120
        while (tree_cpu_s(parent.pid) or 0.0) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the child is running
        meter.start()
        time.sleep(1.0)
        cores = meter.stop()
    finally:
        _stop(parent)
    assert cores is not None
    assert set(cores) == {"host", "server", "client", "others"}
    # the child's busy loop: near one core, even on a loaded host it had some of one
    assert cores["server"] > 0.1
    assert cores["client"] < 0.5  # this process slept
    assert cores["host"] >= cores["server"] - 0.05
    unknown = CoreMeter(None)
    unknown.start()
    assert set(unknown.stop() or {}) == {"host", "client"}  # no server: no split
    assert CoreMeter(None).stop() is None  # never started
