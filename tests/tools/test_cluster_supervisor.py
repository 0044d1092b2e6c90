"""LocalCluster's supervisor: a process that keeps dying right after it starts is restarted
with a growing backoff, not in a tight loop. The process is real (`kvflow serve --role meta`
without --address exits with status 2); time is passed in explicitly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvflow.tools.supervise import FIRST_BACKOFF_S, LocalCluster, Proc

pytestmark = pytest.mark.slow


def _wait_dead(proc: Proc) -> float:
    deadline = time.monotonic() + 60
    while proc.alive():
        assert time.monotonic() < deadline, "the bad process did not exit"
        time.sleep(0.05)
    return time.monotonic()


def test_a_crash_looping_process_backs_off(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, meta=1, prefill=1, decode=1)  # never started
    bad = Proc("bad", ["--role", "meta", "--data-dir", str(tmp_path)], tmp_path / "bad.log")
    cluster.procs = {"bad": bad}
    try:
        bad.start()
        died = _wait_dead(bad)
        assert bad.popen is not None and bad.popen.returncode == 2
        assert cluster.supervise_once(now=died) == []  # a quick death: wait first
        assert bad.backoff_s == FIRST_BACKOFF_S
        assert cluster.supervise_once(now=died + FIRST_BACKOFF_S) == ["bad"]
        died = _wait_dead(bad)
        assert cluster.supervise_once(now=died) == []
        assert bad.backoff_s == 2 * FIRST_BACKOFF_S  # doubled
        assert cluster.supervise_once(now=died + 0.9) == []
        assert cluster.supervise_once(now=died + 1.0) == ["bad"]
        assert bad.restarts == 2
        # A process that had run long before it died is restarted at once.
        died = _wait_dead(bad)
        bad.started_at = died - 60.0
        assert cluster.supervise_once(now=died) == ["bad"]
        assert bad.backoff_s == 0.0
        assert "--address" in (tmp_path / "bad.log").read_text()
    finally:
        bad.stop()
