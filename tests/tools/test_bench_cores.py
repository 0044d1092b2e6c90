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

from kvflow.tools.bench import load
from kvflow.tools.bench._cores import CoreMeter, disturbed, tree_cpu_s
from kvflow.tools.bench.load import Level

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


def test_a_level_beside_other_work_is_marked_disturbed() -> None:
    """A busy process that is neither the server (here an idle one) nor the clients shows in
    ``others``, and the level's summary and line say it ran beside other work."""
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    other = _busy_tree(30.0)
    try:
        deadline = time.monotonic() + 120
        while (tree_cpu_s(other.pid) or 0.0) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the busy child is running
        meter = CoreMeter(idle.pid)
        meter.start()
        time.sleep(1.0)
        cores = meter.stop()
    finally:
        _stop(other)
        idle.kill()
        idle.wait(30)
    assert cores is not None and cores["others"] > 0.3, cores  # most of one core
    level = Level("open_1x", cores=cores)
    assert level.summary()["disturbed"] is True
    assert f"DISTURBED (other processes used {cores['others']:.2f} cores)" in load._short(
        level.summary()
    )


def test_disturbed_is_a_share_of_the_hosts_cores() -> None:
    quiet = {"host": 1.97, "server": 1.95, "client": 0.02, "others": 0.04}
    assert disturbed(quiet, cpus=2) is False
    assert disturbed({**quiet, "others": 0.32}, cpus=2) is True
    assert disturbed({**quiet, "others": 0.32}, cpus=16) is False  # 0.8 cores of 16 is 5%
    assert disturbed({"host": 1.0, "client": 0.1}) is None  # no server: not known
    assert disturbed(None) is None
    assert Level("closed_c1").summary()["disturbed"] is None
