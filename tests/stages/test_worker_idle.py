"""An engine worker's idle tasks (``EngineWorker.add_idle_task``): run on the engine thread
only while the engine has nothing to run and has had nothing for ``IDLE_GRACE_S``, again at
once while they report work, after the idle wait when they do not; a request arriving
meanwhile is served; a failing task is dropped and the worker goes on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvflow.stages.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from kvflow.stages.runtime.worker import IDLE_GRACE_S, EngineWorker, WorkItem

PROMPT = [(7 * i) % 200 + 3 for i in range(40)]
DEADLINE_S = 60.0


def _request(
    rid: str, errors: list[BaseException], ended: list[float]
) -> tuple[WorkItem, threading.Event, list[int]]:
    done, tokens = threading.Event(), []

    def sink(_: Engine, out: RequestOutput) -> None:
        tokens.extend(out.new_token_ids)
        if out.finished:
            ended.append(time.monotonic())
            done.set()

    item = WorkItem(rid, PROMPT, SamplingParams(max_tokens=6), sink, errors.append)
    return item, done, tokens


def test_idle_tasks_run_between_requests_never_beside_them(tiny_model: Path) -> None:
    engine = Engine.open(tiny_model, EngineConfig(block_size=8, num_pages=64, prefill_chunk=16))
    worker = EngineWorker("prefill-0", engine, idle_wait_s=0.05)
    busy_calls: list[bool] = []  # whether the engine had work at each call
    call_times: list[float] = []
    ended: list[float] = []
    pieces = {"left": 5}
    finished = threading.Event()
    resumed = threading.Event()

    def chore() -> int:
        busy_calls.append(engine.has_unfinished())
        call_times.append(time.monotonic())
        if pieces["left"] > 0:
            pieces["left"] -= 1
            return 1
        finished.set()
        if pieces.get("again"):
            resumed.set()
        return 0

    def broken() -> int:
        raise RuntimeError("an idle task that fails is logged and dropped")

    worker.add_idle_task(broken)
    worker.add_idle_task(chore)
    errors: list[BaseException] = []
    worker.start()
    try:
        assert finished.wait(DEADLINE_S)  # five pieces at once, then nothing to do
        calls = len(busy_calls)
        assert calls >= 6
        item, done, tokens = _request("r1", errors, ended)
        worker.submit(item)
        assert done.wait(DEADLINE_S) and len(tokens) == 6 and not errors
        pieces["left"], pieces["again"] = 3, 1  # more work appears: picked up after the wait
        assert resumed.wait(DEADLINE_S)
    finally:
        worker.stop()
    assert not any(busy_calls)  # never while the engine had a request to run
    after = [t for t in call_times if t > ended[0]]
    assert after and after[0] - ended[0] >= IDLE_GRACE_S  # not at once after a request
    assert len(busy_calls) > calls + 3
    assert broken not in worker._idle_tasks
