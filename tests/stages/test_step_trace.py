"""The engine worker's step trace (KVFLOW_STEP_TRACE) and its summary tool."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvflow.stages.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from kvflow.stages.runtime.step_trace import ENV
from kvflow.stages.runtime.worker import EngineWorker, WorkItem
from kvflow.tools.bench import steps


def _run(engine: Engine, requests: dict[str, list[int]], max_tokens: int) -> None:
    """Run ``requests`` through a worker until every one finished."""
    worker = EngineWorker("prefill-0", engine)
    done = {rid: threading.Event() for rid in requests}
    errors: list[BaseException] = []

    def sink(_: Engine, out: RequestOutput) -> None:
        if out.finished:
            done[out.request_id].set()

    worker.start()
    try:
        for rid, tokens in requests.items():
            worker.submit(
                WorkItem(rid, tokens, SamplingParams(max_tokens=max_tokens), sink, errors.append)
            )
        for event in done.values():
            assert event.wait(60), "a request did not finish in 60 s"
    finally:
        worker.stop()
    assert not errors


def test_trace_records_every_step_and_summarizes(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "trace"))
    engine = Engine.open(tiny_model, EngineConfig(block_size=8, num_pages=64, prefill_chunk=16))
    # 20 and 5 prompt tokens under a 16-token chunk: prompt steps, then decode steps
    _run(engine, {"a/prefill": list(range(1, 21)), "b/prefill": list(range(1, 6))}, 4)
    (path,) = tmp_path.glob("trace.*.prefill-0.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum(sum(r["prompt"]) for r in records) == 25  # every prompt token, once
    assert sum(r["tokens"] for r in records) == 8  # 4 tokens each
    assert all(sum(r["prompt"]) <= 16 for r in records)
    assert {rid for r in records for rid, _ in r["admitted"]} == {"a/prefill", "b/prefill"}
    assert sorted(rid for r in records for rid in r["finished"]) == ["a/prefill", "b/prefill"]
    assert all(r["step"] > 0 and r["cpu"] >= 0 and r["gap"] >= 0 for r in records)
    summary = steps.summarize(steps.load(path))
    assert summary["steps"] == len(records)
    assert summary["prompt_tokens"] == 25 and summary["tokens"] == 8
    assert summary["wall_s"] >= summary["in_steps_s"] > 0
    assert sum(k["steps"] for k in summary["kinds"].values()) == len(records)
    assert "decode" in summary["kinds"]  # the last tokens decode alone
    assert steps.main([str(path), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())[str(path)][0]["steps"] == len(records)


def test_no_trace_without_the_variable(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    engine = Engine.open(tiny_model, EngineConfig(block_size=8, num_pages=64))
    _run(engine, {"a": [1, 2, 3]}, 2)
    assert list(tmp_path.iterdir()) == []


def test_prefill_to_decode_lag_pairs_a_colocated_handoff() -> None:
    def rec(t: float, admitted: list[tuple[str, float]], finished: list[str], **kw: object):
        base = {"t": t, "gap": 0.0, "step": 0.1, "cpu": 0.1, "sink": 0.0, "prompt": [],
                "decode": 0, "tokens": 0, "admitted": admitted, "finished": finished}  # fmt: skip
        return {**base, **kw}

    records = [
        rec(0.0, [("r1/prefill", 0.0)], [], prompt=[8]),
        rec(0.1, [], ["r1/prefill"], prompt=[4], tokens=1),  # ends at 0.2
        rec(0.3, [], [], prompt=[8]),
        rec(0.4, [("r1/decode", 0.45)], [], decode=1, tokens=1),
    ]
    summary = steps.summarize(records)
    assert summary["handoffs"] == 1
    assert summary["wall_s"] == pytest.approx(0.5)  # the first start to the last step's end
    assert summary["prefill_to_decode_lag_p50_s"] == pytest.approx(0.25)
    assert summary["prefill_to_decode_lag_steps_mean"] == 1  # it sat out the step at 0.3
    assert summary["kinds"]["prefill"]["steps"] == 3
    assert summary["decode_batch_mean"] == 1.0
    records[2]["gap"] = 5.0
    assert [len(p) for p in steps.phases(records, 1.0)] == [2, 2]
    assert [len(p) for p in steps.phases(records, None)] == [4]
