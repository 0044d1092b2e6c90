"""The cores a benchmark level used, by whom: the server under test (its process and every
descendant: vLLM's engine runs in a child process), the benchmark's own process (the
clients), and every other process on the host. A level that ran beside other work shows it
in ``others`` (Linux; None where /proc cannot be read)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvflow.stages.runtime.step_trace import CLOCK_TICK_S, host_busy_s


def _stat(pid: int, proc: Path) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid`` from ``proc``/pid/stat, or None if it is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S  # ppid; utime + stime


def tree_cpu_s(pid: int, proc: Path = Path("/proc")) -> float | None:
    """CPU seconds used so far by ``pid`` and its living descendants; None if ``pid`` is
    gone or /proc cannot be read."""
    try:
        pids = [int(p) for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return None
    stats = {p: s for p in pids if (s := _stat(p, proc)) is not None}
    if pid not in stats:
        return None
    children: dict[int, list[int]] = {}
    for p, (parent, _) in stats.items():
        children.setdefault(parent, []).append(p)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo.extend(children.get(p, []))
    return total


DISTURBED_SHARE = 0.05
"""The share of the host's cores that other processes may use during a level before the
level counts as disturbed (0.1 of 2 cores; a quiet host here: 0.00-0.04)."""


def disturbed(cores: dict[str, float] | None, cpus: int | None = None) -> bool | None:
    """Whether other processes than the server and the clients used at least
    ``DISTURBED_SHARE`` of the host's ``cpus`` (default: this host's) during a level: its
    numbers then measured the server beside other work. None where that is not known."""
    if cores is None or "others" not in cores:
        return None
    return cores["others"] >= DISTURBED_SHARE * (cpus or os.cpu_count() or 1)


class CoreMeter:
    """``start()`` then ``stop()`` around a level: the mean cores used meanwhile by the host
    (``host``), this process (``client``) and, given the server's ``pid``, the server (it and
    its descendants: ``server``) and every other process (``others``: the host less both)."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._at: tuple[float, float | None, float | None, float] | None = None

    def _sample(self) -> tuple[float, float | None, float | None, float]:
        server = tree_cpu_s(self.pid) if self.pid is not None else None
        return time.monotonic(), host_busy_s(), server, time.process_time()

    def start(self) -> None:
        self._at = self._sample()

    def stop(self) -> dict[str, float] | None:
        if self._at is None:
            return None
        (t0, host0, server0, own0), (t1, host1, server1, own1) = self._at, self._sample()
        wall = t1 - t0
        if host0 is None or host1 is None or wall <= 0:
            return None
        host, own = (host1 - host0) / wall, (own1 - own0) / wall
        cores = {"host": host, "client": own}
        if server0 is not None and server1 is not None:  # else the server is among the others
            cores["server"] = max(0.0, server1 - server0) / wall
            cores["others"] = max(0.0, host - cores["server"] - own)
        return {k: round(v, 2) for k, v in cores.items()}


QUIET_BUSY = 0.15
"""The share of the host's cores (all of them together) below which they count as quiet."""


def wait_quiet(max_s: float, busy_below: float = QUIET_BUSY, window_s: float = 0.5) -> float:
    """Wait, at most ``max_s``, until the host's cores were busy less than ``busy_below`` of a
    ``window_s`` window (``/proc/stat``; no wait where it cannot be read); returns the
    seconds waited. Interleaved, a server can keep the cores busy for a while after its last
    answer (vLLM's CPU build spun ~1 s on both cores here), which the next server's row would
    otherwise pay for."""
    start = time.monotonic()
    cores = os.cpu_count() or 1
    before, at = host_busy_s(), start
    while before is not None and time.monotonic() - start < max_s:
        time.sleep(window_s)
        busy, now = host_busy_s(), time.monotonic()
        if busy is None or (busy - before) / ((now - at) * cores) < busy_below:
            break
        before, at = busy, now
    return time.monotonic() - start
