"""A work item's continuation (``WorkItem.then``): what a colocated decode does with its
prefill. The engine thread admits the item it returns as the request's last output is handed
on, so it runs in the very next step, even while other requests keep the engine stepping."""

from __future__ import annotations

import threading
from pathlib import Path

from kvflow.stages.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from kvflow.stages.runtime.worker import EngineWorker, WorkItem

PROMPT = [(11 * i) % 200 + 3 for i in range(37)]


class Recorder:
    """Per request: the worker step of each output, the tokens, the end."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.steps: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, threading.Event] = {}
        self.errors: list[BaseException] = []

    def item(self, rid: str, tokens: list[int], sampling: SamplingParams, **kw: object) -> WorkItem:
        self.steps[rid], self.tokens[rid], self.done[rid] = [], [], threading.Event()

        def sink(_: Engine, out: RequestOutput) -> None:
            self.steps[rid].append(self.worker.steps)  # the step that gave this output
            self.tokens[rid].extend(out.new_token_ids)
            if out.finished:
                self.done[rid].set()

        return WorkItem(rid, tokens, sampling, sink, self.errors.append, **kw)  # type: ignore[arg-type]


def test_the_continuation_runs_in_the_next_step_beside_a_stream(small_model: Path) -> None:
    # the small demo model: its output depends on the adopted KV (the tiny one barely does)
    engine = Engine.open(small_model, EngineConfig(block_size=8, num_pages=128, prefill_chunk=16))
    worker = EngineWorker("prefill-0", engine)
    rec = Recorder(worker)
    calls: list[str] = []

    def then(_: Engine, out: RequestOutput) -> WorkItem | None:
        calls.append(out.request_id)
        return rec.item(
            "r/decode",
            [*PROMPT, out.new_token_ids[0]],
            SamplingParams(max_tokens=5),
            num_prefix_tokens=len(PROMPT),
            retain_pages=True,
            adopt_from=out.request_id,
        )

    def broken(_: Engine, out: RequestOutput) -> WorkItem | None:
        raise RuntimeError("a continuation that fails is logged; the loop goes on")

    worker.start()
    try:
        stream = rec.item("s", [5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
        worker.submit(stream)
        prefill = rec.item(
            "r/prefill", PROMPT, SamplingParams(max_tokens=1), retain_pages=True, then=then
        )
        worker.submit(prefill)
        worker.submit(rec.item("x", [9, 10], SamplingParams(max_tokens=1), then=broken))
        for rid in ("s", "r/decode", "x"):
            assert rec.done[rid].wait(60), f"{rid} did not finish in 60 s"
        worker.drop("r/decode").result(10)
        assert worker.call(lambda e: e.num_free_pages).result(10) == engine.num_pages
    finally:
        worker.stop()
    assert not rec.errors and calls == ["r/prefill"]
    assert rec.steps["r/decode"][0] == rec.steps["r/prefill"][-1] + 1  # not a step sat out
    # the stream decoded in the steps around it: the engine did not wait for the decode
    assert rec.steps["r/prefill"][-1] in rec.steps["s"]
    assert rec.steps["r/decode"][0] in rec.steps["s"]
    whole = Engine.open(small_model, EngineConfig(block_size=8, num_pages=64))
    assert [*rec.tokens["r/prefill"], *rec.tokens["r/decode"]] == whole.generate(
        [PROMPT], SamplingParams(max_tokens=6)
    )[0]
