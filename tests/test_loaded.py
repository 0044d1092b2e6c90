"""tests/loaded.py (`make test-loaded`): the command runs while N processes spin, its exit
status is returned, and the spinning processes are gone afterwards; the docs' example runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import block
from tests.loaded import SPIN

ROOT = Path(__file__).resolve().parents[1]

# Run as the command: the spinning siblings are the runner's other children.
PROBE = f"SPIN = {SPIN!r}\n" + """
import os, sys
parent = os.getppid()
kids = []
for task in os.listdir(f"/proc/{parent}/task"):
    kids += open(f"/proc/{parent}/task/{task}/children").read().split()
spinning = [k for k in kids if open(f"/proc/{k}/cmdline", "rb").read().split(b"\\0")[1:3]
            == [b"-c", SPIN.encode()]]
print(" ".join(spinning))
sys.exit(3)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_the_command_runs_among_spinning_processes_which_end_with_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.loaded", "--busy", "2", "--", sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr  # the command's own status
    spinning = [int(p) for p in done.stdout.split()]
    assert len(spinning) == 2, done.stdout
    assert not any(alive(p) for p in spinning)


def test_a_missing_command_is_named() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.loaded", "--busy", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "give the command to run after --" in done.stderr


@pytest.mark.slow  # a nested pytest among spinning processes
def test_the_documented_module_under_load_passes() -> None:
    shell = block("testing.md", "loaded-one-module")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        ["bash", "-euc", shell], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
