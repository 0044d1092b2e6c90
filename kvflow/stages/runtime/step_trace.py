"""A per-step trace of an engine worker: what each step computed and where its time went.

Off unless ``KVFLOW_STEP_TRACE=PREFIX`` is set in the server's environment: each worker then
writes one JSON line per engine step to ``PREFIX.<pid>.<worker>.jsonl`` (line-buffered, so a
server stopped by a signal leaves every step it finished). ``python -m
kvflow.tools.bench.steps FILE`` summarizes a trace (docs/performance.md, "Step trace").

A line (``StepRecord``): ``t`` the step's start (``time.perf_counter``), ``gap`` seconds since
the previous step's outputs were handed on (the worker idle or taking commands), ``step``
the step's wall seconds, ``cpu`` the engine thread's CPU seconds in it (below ``step``: the
thread was preempted or blocked), ``sink`` seconds handing the outputs to their sinks,
``prompt`` the prompt tokens of each prefill chunk, ``decode`` the decode batch, ``tokens``
the tokens sampled, ``admitted`` the requests admitted since the previous step (id and
perf_counter time), ``finished`` the requests that finished in this step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from kvflow.stages.engine import RequestOutput
from kvflow.stages.engine.scheduler import StepPlan

logger = logging.getLogger(__name__)

ENV = "KVFLOW_STEP_TRACE"


@dataclass
class StepRecord:
    t: float
    gap: float
    step: float
    cpu: float
    sink: float
    prompt: list[int]
    decode: int
    tokens: int
    admitted: list[tuple[str, float]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    proc_cpu: float = 0.0
    host_busy: float | None = None


CLOCK_TICK_S = 1.0 / (float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0)
"""Seconds in one clock tick, the unit of /proc's CPU times."""


def host_busy_s(stat: Path = Path("/proc/stat")) -> float | None:
    """Seconds the host's CPUs have been busy since boot, summed over CPUs (``/proc/stat``'s
    aggregate line less idle and iowait); None where it cannot be read (not Linux)."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 6 or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) * CLOCK_TICK_S


class StepTrace:
    """Writes a worker's steps as JSON lines to ``path``. Used by the worker's one thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._out: IO[str] | None = open(path, "w", buffering=1)  # noqa: SIM115 (closed by close)
        self._admitted: list[tuple[str, float]] = []
        self._last_end = time.perf_counter()
        self._started = self._last_end
        self._cpu_started = 0.0
        self._proc_started = 0.0
        self._host_started: float | None = None
        logger.info("step trace: %s", path)

    @classmethod
    def from_env(cls, worker: str) -> StepTrace | None:
        """The trace of worker ``worker`` if ``KVFLOW_STEP_TRACE`` is set, else None."""
        prefix = os.environ.get(ENV)
        if not prefix:
            return None
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in worker)
        return cls(Path(f"{prefix}.{os.getpid()}.{safe}.jsonl"))

    def admitted(self, request_id: str) -> None:
        self._admitted.append((request_id, time.perf_counter()))

    def begin(self, started: float, cpu_started: float) -> None:
        """The engine step started at ``started`` (perf_counter) with the engine thread's
        ``cpu_started`` (thread_time)."""
        self._started = started
        self._cpu_started = cpu_started
        self._proc_started = time.process_time()
        self._host_started = host_busy_s()

    def end(
        self, plan: StepPlan | None, stepped: float, cpu: float, outputs: list[RequestOutput]
    ) -> None:
        """The step's outputs were handed on; ``stepped``: perf_counter when ``step()``
        returned, ``cpu``: thread_time then."""
        if self._out is None:
            return
        now = time.perf_counter()
        host, host_started = host_busy_s(), self._host_started
        record = StepRecord(
            t=self._started,
            gap=self._started - self._last_end,
            step=stepped - self._started,
            cpu=cpu - self._cpu_started,
            sink=now - stepped,
            prompt=[] if plan is None else [n for _, n in plan.prefill],
            decode=0 if plan is None else len(plan.decode),
            tokens=sum(len(o.new_token_ids) for o in outputs),
            admitted=self._admitted,
            finished=[o.request_id for o in outputs if o.finished],
            proc_cpu=time.process_time() - self._proc_started,
            host_busy=None if host is None or host_started is None else host - host_started,
        )
        self._admitted = []
        self._last_end = now
        self._out.write(json.dumps(asdict(record)) + "\n")

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
