"""An embedded `kvflow serve` (tiny demo model, LMDB tier) and its data dir, as issue 25 found
them: a second server on the same data dir started too (and hung, damaging the journal), and
a damaged tier or journal stopped the server. Now the second is refused in one line naming
the holder's pid, and a server whose tier file and journal were truncated starts, saying so
once for each."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvflow.stages.engine import write_demo_model

pytestmark = [pytest.mark.faults, pytest.mark.slow]

DEADLINE_S = 180.0
SERVING = "kvflow serving"


def _command(model: Path, data: Path) -> list[str]:
    return [sys.executable, "-m", "kvflow.tools.cli", "serve", "--model", str(model),
            "--data-dir", str(data), "--port", "0", "--http-port", "0", "--metrics-port", "0",
            "--storage-engine", "lmdb", "--dram-mb", "64", "--ssd-mb", "64"]  # fmt: skip


def _start(model: Path, data: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(_command(model, data), stdout=out, stderr=subprocess.STDOUT)


def _wait_serving(proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while SERVING not in (text := log.read_text(errors="replace")):
        assert proc.poll() is None, f"exited {proc.returncode}:\n{text}"
        assert time.monotonic() < deadline, text
        time.sleep(0.1)
    return text


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(30)


def test_a_second_server_is_refused_and_damage_does_not_stop_a_start(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "tiny", preset="tiny", seed=0)
    data = tmp_path / "data"
    first = _start(model, data, tmp_path / "first.log")
    try:
        _wait_serving(first, tmp_path / "first.log")
        second = subprocess.run(
            _command(model, data), capture_output=True, text=True, timeout=DEADLINE_S
        )
        assert second.returncode == 1, second.stdout + second.stderr
        refusal = [line for line in second.stderr.splitlines() if "cannot start" in line]
        assert len(refusal) == 1, second.stderr
        assert f"{data / 'meta'} is in use by process {first.pid}" in refusal[0]
        assert "Traceback" not in second.stderr
    finally:
        assert _stop(first) == 0

    tier = data / "shards" / "prefill-0" / "ssd" / "data.mdb"
    journal = data / "meta" / "raft.journal"
    tier.write_bytes(tier.read_bytes()[:100])
    journal.write_bytes(journal.read_bytes()[:60])
    again = _start(model, data, tmp_path / "again.log")
    try:
        text = _wait_serving(again, tmp_path / "again.log")
    finally:
        assert _stop(again) == 0
    assert text.count("SSD tier damaged") == 1, text
    assert text.count("metadata journal damaged") == 1, text
    assert len(list(tier.parent.parent.glob("ssd.damaged-*"))) == 1
