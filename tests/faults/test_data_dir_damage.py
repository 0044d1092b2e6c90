"""Damaged and shared kvdb data dirs, each in a process of its own (``shard_child``).

Before issue 25 item 3: a truncated LMDB file killed the process with SIGBUS, a damaged SSD
tier stopped it from starting (it only holds a cache), and two processes on one LMDB data dir
both started. Now the tier is moved aside with one log line and the shard starts (its blocks
are misses, never wrong bytes), and a second process is refused with a line naming the dir
and the holder's pid, for every engine."""

from __future__ import annotations

import json
import random
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import pick_free_port
from tests.faults.roles import Role, run_role
from tests.faults.shard_child import BLOCKS

pytestmark = [pytest.mark.faults]

TIMEOUT_S = 120.0
ROOT = Path(__file__).resolve().parents[2]  # `python -m tests.faults.shard_child` runs here
QUARANTINED = "SSD tier damaged"


def child(engine: str, data_dir: Path, action: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.faults.shard_child", engine, str(data_dir), action],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        cwd=ROOT,
    )


def _largest(directory: Path, suffix: str) -> Path:
    files = [p for p in directory.iterdir() if p.name.endswith(suffix)]
    assert files, f"no *{suffix} in {sorted(p.name for p in directory.iterdir())}"
    return max(files, key=lambda p: p.stat().st_size)


def _damage(engine: str, ssd: Path, mode: str) -> None:
    target = _largest(ssd, ".mdb" if engine == "lmdb" else ".sst")
    data = bytearray(target.read_bytes())
    if mode == "truncate":
        target.write_bytes(data[: len(data) // 2])
    else:
        middle = len(data) // 2
        data[middle : middle + 8192] = random.Random(25).randbytes(8192)
        target.write_bytes(data)


@pytest.mark.parametrize("engine", ["rocksdb", "lmdb"])
@pytest.mark.parametrize("mode", ["truncate", "garbage"])
def test_a_damaged_ssd_tier_is_quarantined_and_the_shard_starts(
    tmp_path: Path, engine: str, mode: str
) -> None:
    data_dir = tmp_path / "data"
    filled = child(engine, data_dir, "fill")
    assert filled.returncode == 0, filled.stderr
    _damage(engine, data_dir / "ssd", mode)

    read = child(engine, data_dir, "read")
    assert read.returncode == 0, f"exit {read.returncode} (negative: a signal)\n{read.stderr}"
    result = json.loads(read.stdout.strip().splitlines()[-1])
    assert result["wrong"] == 0  # damaged blocks are misses, never wrong bytes
    assert result["present"] < BLOCKS or mode == "garbage"
    lines = [line for line in read.stderr.splitlines() if QUARANTINED in line]
    aside = [p for p in data_dir.iterdir() if p.name.startswith("ssd.damaged-")]
    if mode == "truncate":
        assert len(lines) == 1, read.stderr
        assert len(aside) == 1 and str(aside[0]) in lines[0]
    assert len(lines) == len(aside) <= 1

    again = child(engine, data_dir, "read")  # the fresh tier opens as any other
    assert again.returncode == 0, again.stderr
    assert QUARANTINED not in again.stderr


@pytest.mark.parametrize("engine", ["rocksdb", "lmdb"])
def test_an_unreadable_manifest_is_moved_aside_with_its_tier(tmp_path: Path, engine: str) -> None:
    data_dir = tmp_path / "data"
    assert child(engine, data_dir, "fill").returncode == 0
    manifest = data_dir / "kvdb-manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:20])  # cut mid-JSON

    read = child(engine, data_dir, "read")
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout.strip().splitlines()[-1]) == {"present": 0, "wrong": 0}
    lines = [line for line in read.stderr.splitlines() if "kvdb data dir damaged" in line]
    assert len(lines) == 1, read.stderr
    aside = sorted(p.name.split(".damaged-")[0] for p in data_dir.glob("*.damaged-*"))
    assert aside == ["kvdb-manifest.json", "ssd"]
    assert child(engine, data_dir, "read").returncode == 0


def test_a_truncated_lmdb_file_maps_nothing_past_its_end(tmp_path: Path) -> None:
    """The check runs before LMDB maps the file: truncated to any length, no SIGBUS."""
    data_dir = tmp_path / "data"
    assert child("lmdb", data_dir, "fill").returncode == 0
    path = data_dir / "ssd" / "data.mdb"
    whole = path.read_bytes()
    for cut in (10, 4096, 3 * 4096 + 17, len(whole) - 4096):
        ssd = data_dir / "ssd"
        for leftover in data_dir.glob("ssd.damaged-*"):
            for f in leftover.iterdir():
                f.unlink()
            leftover.rmdir()
        path.write_bytes(whole[:cut])
        read = child("lmdb", data_dir, "read")
        assert read.returncode == 0, f"cut {cut}: exit {read.returncode}\n{read.stderr}"
        assert QUARANTINED in read.stderr
        # put the filled tier back for the next cut
        for f in ssd.iterdir():
            f.unlink()
        path.write_bytes(whole)


@pytest.mark.parametrize("engine", ["rocksdb", "lmdb", "memory"])
def test_a_data_dir_in_use_is_refused(tmp_path: Path, engine: str) -> None:
    data_dir = tmp_path / "data"
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.faults.shard_child", engine, str(data_dir), "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        deadline = time.monotonic() + TIMEOUT_S
        ready, _, _ = select.select([holder.stdout], [], [], TIMEOUT_S)
        assert ready and holder.stdout.readline().strip() == "holding"
        assert time.monotonic() < deadline

        second = child(engine, data_dir, "read")
        assert second.returncode == 1, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert str(data_dir) in lines[0] and f"in use by process {holder.pid}" in lines[0]

        holder.stdin.close()
        assert holder.wait(timeout=TIMEOUT_S) == 0
        after = child(engine, data_dir, "read")  # the lock went with its process
        assert after.returncode == 0, after.stderr
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=TIMEOUT_S)


def test_a_second_replica_on_one_journal_is_refused_naming_the_holder(tmp_path: Path) -> None:
    """Two `kvflow serve --role meta` processes with one data dir and meta id: the second
    exits 1 with one line naming the journal dir and the first one's pid."""
    data = tmp_path / "data"

    def argv() -> list[str]:
        return ["--role", "meta", "--meta-id", "0", "--address", f"127.0.0.1:{pick_free_port()}",
                "--data-dir", str(data), "--metrics-port", "0"]  # fmt: skip

    first = Role("meta-0", argv(), tmp_path / "first.log").start()
    try:
        first.wait_for("kvflow meta 0: raft")
        second = run_role(argv(), timeout_s=TIMEOUT_S)
        assert second.returncode == 1, second.stdout + second.stderr
        assert first.proc is not None
        lines = [line for line in second.stderr.splitlines() if "in use" in line]
        assert len(lines) == 1, second.stderr
        assert f"{data / 'meta-0'} is in use by process {first.proc.pid}" in lines[0]
        assert "Traceback" not in second.stderr + second.stdout
    finally:
        first.stop()
