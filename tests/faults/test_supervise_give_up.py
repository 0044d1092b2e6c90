"""The supervisor stops restarting a role that fails the same way again and again, and says
so (a log line, ``Proc.status``, ``LocalCluster.failed``); a role that fails differently each
time is still restarted. Before issue 25 item 3 a replica whose start could not proceed was
restarted forever."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from kvflow.replication.dir_guard import claim_dir
from kvflow.tools import supervise as sv
from tests.conftest import pick_free_port

pytestmark = [pytest.mark.faults]

DEADLINE_S = 120.0


@pytest.fixture(autouse=True)
def _short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sv, "FIRST_BACKOFF_S", 0.05)
    monkeypatch.setattr(sv, "MAX_BACKOFF_S", 0.2)


def _supervise_until(proc: sv.Proc, done: object, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: {proc.status()}\n{proc.log_path.read_text()}"
        sv.supervise([proc])
        time.sleep(0.05)


def test_a_role_that_cannot_start_is_given_up_after_three_same_failures(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real metadata replica whose journal dir this test holds: it says why in one line and
    exits 1, three times; the supervisor then reports it and stops restarting it."""
    data = tmp_path / "data"
    held = claim_dir(data / "meta-0", "test")
    proc = sv.Proc(
        "meta-0",
        ["--role", "meta", "--meta-id", "0", "--address", f"127.0.0.1:{pick_free_port()}",
         "--data-dir", str(data), "--metrics-port", "0"],
        tmp_path / "meta-0.log",
    )  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger=sv.__name__):
            proc.start()
            _supervise_until(proc, lambda: proc.failed is not None, "give up")
        assert proc.restarts == sv.GIVE_UP_AFTER - 1
        assert not proc.alive()
        assert proc.failed is not None and proc.failed.startswith("exit 1: ")
        assert f"{data / 'meta-0'} is in use by process {os.getpid()}" in proc.failed
        assert proc.status() == f"failed: {proc.failed}"
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "not restarting it" in errors[0], errors
        assert sv.supervise([proc]) == []  # and it stays down
        assert proc.restarts == sv.GIVE_UP_AFTER - 1
    finally:
        proc.stop()
        held.release()


def test_a_role_failing_differently_each_time_is_still_restarted(tmp_path: Path) -> None:
    counter = tmp_path / "attempts"
    proc = sv.Proc(
        "flaky",
        [str(counter), "vary"],
        tmp_path / "flaky.log",
        module=("tests.faults.fail_child",),
    )
    try:
        proc.start()
        _supervise_until(proc, lambda: proc.restarts >= sv.GIVE_UP_AFTER + 1, "restarts")
        assert proc.failed is None
    finally:
        proc.stop()


def test_same_failures_are_given_up(tmp_path: Path) -> None:
    proc = sv.Proc(
        "broken",
        [str(tmp_path / "attempts"), "same"],
        tmp_path / "broken.log",
        module=("tests.faults.fail_child",),
    )
    try:
        proc.start()
        _supervise_until(proc, lambda: proc.failed is not None, "give up")
        assert proc.failed == "exit 3: fail_child: cannot start"
        assert (tmp_path / "attempts").read_text() == str(sv.GIVE_UP_AFTER)
    finally:
        proc.stop()


def test_a_serve_role_that_cannot_start_says_why_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvflow serve``'s roles run their start through ``_started``: a refusal from the data
    dir (here, held by another process) is one stderr line and exit code 1, no traceback."""
    from kvflow.kvdb.errors import DataDirInUseError
    from kvflow.tools.serve import _started

    def start() -> None:
        raise DataDirInUseError(f"kvdb data dir {tmp_path} is in use by process 4242\n(lock)")

    assert _started("kvflow serve --role node", start) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        f"kvflow serve --role node: cannot start: kvdb data dir {tmp_path} is in use by "
        "process 4242 (lock)\n"
    )
