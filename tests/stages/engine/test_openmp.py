"""torch's OpenMP threads in a serving process (engine/openmp.py): only the threads that set
their own count build teams, and ``Waiting`` really switches libgomp between spinning and
sleeping at barriers (seen as the process's voluntary context switches, in a fresh process so
no earlier test's teams count)."""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvflow.stages.engine import openmp

pytestmark = pytest.mark.skipif(openmp.gomp() is None, reason="torch's OpenMP is not libgomp")


def _in_thread(fn: object) -> object:
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()))  # type: ignore[operator]
    t.start()
    t.join(60)
    return out[0]


def test_reserve_leaves_teams_to_threads_that_set_their_count() -> None:
    before = torch.get_num_threads()
    release = openmp.reserve()
    try:
        inner = openmp.reserve()  # a second server in the process
        assert _in_thread(torch.get_num_threads) == 1  # other threads: no team
        assert openmp.default_threads() == before  # what engine workers without a count get

        def engine_thread() -> tuple[int, int]:
            openmp.set_thread_count(2)
            torch.ones(1 << 20).add_(1)  # a parallel region: torch's per-thread init is done
            return torch.get_num_threads(), _in_thread(torch.get_num_threads)  # type: ignore[return-value]

        own, started_by_it = engine_thread_result = _in_thread(engine_thread)  # type: ignore[misc]
        assert (own, started_by_it) == (2, 1), engine_thread_result
        inner()
        inner()  # idempotent
        assert _in_thread(torch.get_num_threads) == 1  # the outer reservation holds
    finally:
        release()
    assert torch.get_num_threads() == before
    assert _in_thread(torch.get_num_threads) == before
    with pytest.raises(ValueError, match="thread count must be >= 1"):
        openmp.set_thread_count(0)


@pytest.mark.skipif(openmp.gomp() is None or openmp.mkl() is None, reason="libgomp and MKL")
def test_an_engine_threads_count_reaches_mkl() -> None:
    """After reserve() a thread's MKL count is 1 once torch has set it up (ATen's per-thread
    init copies the process default into MKL's own count); set_thread_count gives the
    engine thread's MKL products (torch.mm in float32) its count, other threads keep 1."""
    lib = openmp.mkl()
    assert lib is not None
    lib.mkl_get_max_threads.restype = ctypes.c_int

    def mkl_count() -> int:
        torch.get_num_threads()  # ATen's lazy per-thread init, as a thread's first op does
        return int(lib.mkl_get_max_threads())

    release = openmp.reserve()
    try:
        assert _in_thread(mkl_count) == 1

        def engine_thread() -> tuple[int, int]:
            openmp.set_thread_count(2)
            return mkl_count(), _in_thread(mkl_count)  # type: ignore[return-value]

        assert _in_thread(engine_thread) == (2, 1)
    finally:
        release()


def test_wait_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(openmp.ENV_WAIT, raising=False)
    assert openmp.wait_mode() == "adaptive"
    monkeypatch.setenv(openmp.ENV_WAIT, "sleep")
    assert openmp.wait_mode() == "sleep"
    monkeypatch.setenv(openmp.ENV_WAIT, "always")
    with pytest.raises(ValueError, match="KVFLOW_OMP_WAIT must be one of"):
        openmp.wait_mode()


def test_spin_control_reports_windows_by_cpu_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(openmp.ENV_WAIT, raising=False)
    waiting = openmp.Waiting(team=2)
    control, other = openmp.SpinControl(waiting), openmp.SpinControl(waiting)
    try:
        control.step(0.2, 0.5)
        assert not waiting.sleeping  # half a window: no verdict yet
        control.step(0.2, 0.5)  # a window at 40% CPU: the cores were not the engine's
        assert waiting.sleeping
        other.step(1.0, 1.0)  # its window spanned the change of mode: dropped
        other.step(1.0, 1.0)  # another engine had its cores: the first one still waits
        assert waiting.sleeping
        control.step(0.95, 1.0)
        assert not waiting.sleeping
        other.step(0.1, 1.0)  # spanned the change: dropped
        assert not waiting.sleeping
        other.step(0.1, 1.0)
        assert waiting.sleeping
        other.close()  # a stopped worker's verdict no longer counts
        assert not waiting.sleeping
    finally:
        control.close()
        waiting.spin()


def test_sleeping_probes_by_spinning_for_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sleeping team's steps have a low CPU share on free cores too (its engine thread
    sleeps at every barrier), so sleeping alone cannot show that the cores are free: every
    few contended windows it spins for one, whose share decides."""
    monkeypatch.delenv(openmp.ENV_WAIT, raising=False)
    waiting = openmp.Waiting(team=2)
    control = openmp.SpinControl(waiting)

    def windows(n: int, share: float) -> None:
        for _ in range(n):
            control.step(share, 1.0)

    try:
        windows(1, 0.5)
        assert waiting.sleeping
        windows(openmp.PROBE_AFTER - 1, 0.5)
        assert waiting.sleeping
        windows(1, 0.5)  # the PROBE_AFTER-th contended window asleep: a probe
        assert not waiting.sleeping
        windows(1, 0.5)  # the probe found the cores taken: back to sleep, probes rarer
        assert waiting.sleeping
        windows(2 * openmp.PROBE_AFTER - 1, 0.5)
        assert waiting.sleeping
        windows(1, 0.5)
        assert not waiting.sleeping  # the second probe, twice as late
        windows(1, 0.95)  # the cores are free: it stays spinning
        assert not waiting.sleeping
        windows(3, 0.95)
        assert not waiting.sleeping
        windows(1, 0.5)  # taken again: sleeping, probes at the first interval again
        windows(openmp.PROBE_AFTER, 0.5)
        assert not waiting.sleeping
    finally:
        control.close()
        waiting.spin()


def test_probes_back_off_to_at_most_probe_max(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(openmp.ENV_WAIT, raising=False)
    waiting = openmp.Waiting(team=2)
    control = openmp.SpinControl(waiting)
    spinning_at = []
    try:
        for window in range(400):
            if not waiting.sleeping:
                spinning_at.append(window)
            control.step(0.5, 1.0)  # the cores stay taken
        gaps = [b - a for a, b in itertools.pairwise(spinning_at)]
        assert gaps[:4] == [1 + openmp.PROBE_AFTER * k for k in (1, 2, 4, 8)]
        assert max(gaps) == 1 + openmp.PROBE_MAX
        assert len(spinning_at) < 400 / openmp.PROBE_MAX + 6  # ~3% of the windows spin
    finally:
        control.close()
        waiting.spin()


def test_fixed_modes_do_not_adapt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(openmp.ENV_WAIT, "spin")
    waiting = openmp.Waiting(team=2)
    control = openmp.SpinControl(waiting)
    control.step(0.1, 2.0)
    assert not waiting.sleeping
    control.close()


_PROBE = """
import json, resource, sys, threading, torch
from kvflow.stages.engine import openmp
release = openmp.reserve()
waiting = openmp.Waiting(team=openmp.cores())
out = {}
def engine():
    openmp.set_thread_count(2)
    x = torch.ones(2 * 65536)
    def once():
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        for _ in range(1500):
            x.add_(1)  # a short parallel region of 2 threads, then a barrier
        return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - r0
    def switches():
        # the fewest of 5: on a loaded host a spinning team whose partner is preempted
        # sleeps too, so one measurement can hit a busy spell
        return min(once() for _ in range(5))
    once()
    out["spin"] = switches()
    waiting.sleep()
    out["sleep"] = switches()
    waiting.spin()
    out["spin_again"] = switches()
t = threading.Thread(target=engine)
t.start()
t.join(120)
release()
print(json.dumps(out))
"""


@pytest.mark.skipif(openmp.cores() < 2, reason="needs 2 CPUs for a team of 2")
def test_waiting_switches_libgomp_between_spinning_and_sleeping() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env.pop(openmp.ENV_WAIT, None)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    # sleeping: the team's threads block in the kernel at (nearly) every one of 1,500 regions,
    # in every measurement; spinning: they sleep only when one was preempted for a long time
    # (each count is the fewest of five measurements, see _PROBE)
    assert counts["sleep"] > 500, counts
    assert counts["sleep"] > 3 * max(counts["spin"], counts["spin_again"]), counts


def test_sleep_mode_starts_sleeping_without_waiting_on_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``KVFLOW_OMP_WAIT=sleep``: the process's Waiting starts its keeper at once (it once
    waited 10 s on a lock the keeper's thread needed)."""
    monkeypatch.setenv(openmp.ENV_WAIT, "sleep")
    monkeypatch.setattr(openmp, "_waiting", [])
    started = time.monotonic()
    waiting = openmp.waiting()
    try:
        assert waiting is not None and waiting.sleeping
        assert time.monotonic() - started < 5.0
        control = openmp.SpinControl(waiting)
        waiting.report(id(control), contended=False)
        control.close()  # a worker that stops does not end the fixed mode
        assert waiting.sleeping
    finally:
        if waiting is not None:
            waiting.spin()
