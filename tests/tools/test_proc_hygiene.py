"""A supervised child dies with its supervisor, even when the supervisor is SIGKILLed (on the
code before PR_SET_PDEATHSIG it ran on, holding its ports)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import sys, time
from pathlib import Path
from kvflow.tools.supervise import Proc
args = ["-n", "1", "import time; time.sleep(60)"]
proc = Proc("child", args, Path(sys.argv[1]), module=("timeit",))
proc.start()
print(proc.popen.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_a_child_dies_when_its_supervisor_is_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "child.log")],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 30
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        parent.kill()
        parent.wait(10)
        if "child" in locals() and alive(child):
            os.kill(child, signal.SIGKILL)
