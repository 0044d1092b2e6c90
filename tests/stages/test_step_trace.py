"""The engine worker's step trace (KVFLOW_STEP_TRACE) and its summary tool."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from kvflow.stages.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from kvflow.stages.runtime.step_trace import ENV, host_busy_s
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
    assert all(r["proc_cpu"] >= 0 for r in records)
    if Path("/proc/stat").exists():  # Linux: every step saw the host's CPU counters
        assert all(r["host_busy"] is not None and r["host_busy"] >= 0 for r in records)
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


def test_host_busy_reads_the_aggregate_cpu_line(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice (guest is inside user)
    stat.write_text("cpu  100 2 50 1000 20 5 3 1 40 0\ncpu0 50 1 25 500 10 2 1 0 20 0\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert host_busy_s(stat) == pytest.approx((100 + 2 + 50 + 5 + 3 + 1) / tick)
    stat.write_text("intr 1 2 3\n")
    assert host_busy_s(stat) is None
    assert host_busy_s(tmp_path / "absent") is None


def test_cores_splits_this_process_from_the_others() -> None:
    def rec(proc_cpu: float, host_busy: float | None) -> dict[str, object]:
        return {"t": 0.0, "gap": 0.0, "step": 0.09, "cpu": 0.08, "sink": 0.01, "prompt": [],
                "decode": 8, "tokens": 8, "admitted": [], "finished": [],
                "proc_cpu": proc_cpu, "host_busy": host_busy}  # fmt: skip

    # 0.1 s each (step + sink): this process used 1.6 cores, the host 2.0 in all
    summary = steps.summarize([rec(0.16, 0.2), rec(0.16, 0.2)])
    assert summary["process_cores"] == pytest.approx(1.6)
    assert summary["other_cores"] == pytest.approx(0.4)
    assert summary["kinds"]["decode"]["other_cores"] == pytest.approx(0.4)
    assert "this process 1.60, others 0.40" in steps.line("t", summary)
    # a trace from before these fields, or a host without /proc/stat: no cores, no claim
    old = {k: v for k, v in rec(0.16, 0.2).items() if k not in ("proc_cpu", "host_busy")}
    for records in ([old], [rec(0.16, None)]):
        summary = steps.summarize(records)
        assert summary["process_cores"] is None and summary["other_cores"] is None
        assert "others" not in steps.line("t", summary)
