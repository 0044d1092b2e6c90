"""`make run ARGS="..."` hands the extra flags to `kvflow serve`: the README's line, run as
`make -n` (a dry run: nothing is installed or started)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.docs.blocks import block

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_run_passes_args() -> None:
    line = block("README.md", "readme-make-run-args").strip()
    assert line.startswith("make run ARGS=")
    out = subprocess.run(
        ["bash", "-c", line.replace("make run", "make -n run", 1)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert ".venv/bin/kvflow serve --http-port 9000 --dram-mb 128" in out.stdout
