"""Tracer ring buffer, Chrome/Perfetto export and import, per-stage breakdown."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvflow.pipeline import (
    RequestTrace,
    Span,
    Tracer,
    TraceStatus,
    format_breakdown,
    from_chrome_trace,
    load_traces,
    stage_breakdown,
    to_chrome_trace,
    traces_from_dict,
    traces_to_dict,
    write_chrome_trace,
)
from kvflow.pipeline.tracing import percentile


def make_trace(rid: str, start: float, durations: dict[str, float]) -> RequestTrace:
    """Stage spans laid end to end, plus one child span under the first stage."""
    spans = []
    t = start
    for span_id, (name, duration) in enumerate(durations.items(), start=1):
        spans.append(Span(name, t, duration, {"blocks_hit": span_id}, None, span_id, name))
        t += duration
    first = spans[0]
    spans.append(Span("kvdb_get", first.start_s, first.duration_s / 2, {}, 1, 99, first.name))
    return RequestTrace(rid, tuple(spans), TraceStatus.OK, None, {"tenant": "t"})


def test_tracer_ring_buffer_keeps_newest_and_counts_drops() -> None:
    tracer = Tracer(3)
    for i in range(5):
        tracer.record(RequestTrace(f"r{i}"))
    assert [t.request_id for t in tracer.traces()] == ["r2", "r3", "r4"]
    assert [t.request_id for t in tracer.traces(last=2)] == ["r3", "r4"]
    assert tracer.traces(last=0) == []
    assert tracer.dropped == 2 and len(tracer) == 3
    assert tracer.find("r3") is not None and tracer.find("r0") is None
    tracer.clear()
    assert len(tracer) == 0 and tracer.dropped == 0
    with pytest.raises(ValueError, match="capacity"):
        Tracer(0)
    with pytest.raises(TypeError, match="RequestTrace"):
        tracer.record("r")  # type: ignore[arg-type]


def test_tracer_is_thread_safe() -> None:
    tracer = Tracer(10_000)

    def writer(n: int) -> None:
        for i in range(500):
            tracer.record(RequestTrace(f"{n}-{i}"))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(tracer) == 2000 and tracer.dropped == 0


def test_chrome_trace_is_valid_json_with_one_event_per_span(tmp_path: Path) -> None:
    traces = [
        make_trace("a", 10.0, {"tokenize": 0.001, "prefill": 0.020, "decode": 0.1}),
        make_trace("b", 10.5, {"tokenize": 0.002, "prefill": 0.030}),
    ]
    traces.append(RequestTrace("c", (), TraceStatus.CANCELLED, "RequestCancelled: x"))
    document = to_chrome_trace(traces)
    text = json.dumps(document, allow_nan=False)  # strict JSON
    events = json.loads(text)["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(len(t.spans) for t in traces) == 7
    for event in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= event.keys()
    first = next(e for e in complete if e["name"] == "tokenize" and e["pid"] == 1)
    assert first["ts"] == 0.0 and first["dur"] == pytest.approx(1000.0)
    assert first["args"]["blocks_hit"] == 1 and first["cat"] == "stage"
    prefill_b = next(e for e in complete if e["name"] == "prefill" and e["pid"] == 2)
    assert prefill_b["ts"] == pytest.approx(502_000.0)
    # tid per stage lane, shared by requests; the child lives in its stage's lane
    tids = {e["name"]: e["tid"] for e in complete}
    assert tids["kvdb_get"] == tids["tokenize"] and len({tids[n] for n in tids}) == 3
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(1, "req a"), (2, "req b"), (3, "req c")}
    one_pid = to_chrome_trace(traces, pid_per="process")
    assert {e["pid"] for e in one_pid["traceEvents"]} == {1}
    with pytest.raises(ValueError, match="pid_per"):
        to_chrome_trace(traces, pid_per="thread")  # type: ignore[arg-type]

    path = tmp_path / "trace.json"
    assert write_chrome_trace(traces, path) == 7
    back = load_traces(path)
    assert [t.request_id for t in back] == ["a", "b", "c"]
    assert back[2].status is TraceStatus.CANCELLED and back[2].error == "RequestCancelled: x"
    assert back[0].attrs == {"tenant": "t"}
    for original, restored in zip(traces, back, strict=True):
        assert len(restored.spans) == len(original.spans)
        for a, b in zip(original.spans, restored.spans, strict=True):
            assert (a.name, a.parent, a.span_id, a.stage, dict(a.attrs)) == (
                b.name, b.parent, b.span_id, b.stage, dict(b.attrs),
            )  # fmt: skip
            assert b.start_s == pytest.approx(a.start_s) and b.duration_s == pytest.approx(
                a.duration_s
            )


def test_native_json_round_trip_and_bad_input(tmp_path: Path) -> None:
    traces = [make_trace("a", 1.0, {"s": 0.5})]
    document = traces_to_dict(traces)
    assert traces_from_dict(json.loads(json.dumps(document))) == traces
    path = tmp_path / "native.json"
    path.write_text(json.dumps(document))
    assert load_traces(path) == traces
    with pytest.raises(ValueError, match="not a kvflow trace"):
        traces_from_dict({"format": "other"})
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match=r"bad\.json: not JSON"):
        load_traces(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="traceEvents"):
        from_chrome_trace({"traceEvents": 3})


def test_attributes_are_made_json_safe() -> None:
    span = Span("s", 0.0, 1.0, {"nan": float("nan"), "obj": object(), "t": (1, 2), 3: "k"})
    document = to_chrome_trace([RequestTrace("r", (span,))])
    text = json.dumps(document, allow_nan=False)
    args = json.loads(text)["traceEvents"][-1]["args"]
    assert args["nan"] == "nan" and args["t"] == [1, 2] and args["3"] == "k"
    assert args["obj"].startswith("<object")


def test_percentiles_are_exact_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 0)


def test_stage_breakdown_on_a_hand_made_set() -> None:
    # prefill durations 1..100 ms over 100 requests; decode 10 ms each on the even ones.
    traces = []
    for i in range(1, 101):
        durations = {"prefill": i / 1000.0}
        if i % 2 == 0:
            durations["decode"] = 0.010
        traces.append(make_trace(f"r{i}", float(i), durations))
    rows = stage_breakdown(traces)
    assert [r.stage for r in rows] == ["prefill", "decode"]
    prefill, decode = rows
    assert prefill.count == 100
    assert prefill.p50_ms == pytest.approx(50.0)
    assert prefill.p90_ms == pytest.approx(90.0)
    assert prefill.p99_ms == pytest.approx(99.0)
    assert prefill.mean_ms == pytest.approx(50.5)
    assert prefill.max_ms == pytest.approx(100.0)
    assert decode.count == 50 and decode.p99_ms == pytest.approx(10.0)
    with_children = stage_breakdown(traces, include_children=True)
    child = next(r for r in with_children if r.stage == "prefill/kvdb_get")
    assert child.count == 100 and child.p50_ms == pytest.approx(25.0)
    # the same numbers from the Chrome document
    from_doc = stage_breakdown(json.loads(json.dumps(to_chrome_trace(traces))))
    assert [(r.stage, r.count) for r in from_doc] == [("prefill", 100), ("decode", 50)]
    assert from_doc[0].p90_ms == pytest.approx(90.0)
    table = format_breakdown(rows)
    lines = table.splitlines()
    assert lines[0].split() == ["stage", "count", "p50", "ms", "p90", "ms", "p99", "ms",
                                "mean", "ms", "max", "ms"]  # fmt: skip
    assert lines[2].split() == ["prefill", "100", "50.000", "90.000", "99.000", "50.500", "100.000"]
    assert format_breakdown([]) == "no spans"
