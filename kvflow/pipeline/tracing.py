"""Trace export (Chrome/Perfetto JSON), import, and the per-stage latency breakdown.

The file format is the Chrome trace event format (``{"traceEvents": [...]}``), which Perfetto
and chrome://tracing open directly: one complete event (``ph: "X"``) per span, ``ts``/``dur``
in microseconds from the earliest span, ``pid`` per request (or one pid for all), ``tid`` per
stage lane, ``args`` = the span's attributes plus a reserved ``"_kvflow"`` entry holding what is
needed to read the file back into ``RequestTrace`` objects offline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvflow.pipeline.spans import (
    RequestTrace,
    Span,
    Tracer,
    TraceStatus,
    json_safe,
    traces_from_dict,
    traces_to_dict,
)

__all__ = [
    "RequestTrace",
    "Span",
    "StageStats",
    "TraceStatus",
    "Tracer",
    "format_breakdown",
    "from_chrome_trace",
    "load_traces",
    "percentile",
    "stage_breakdown",
    "to_chrome_trace",
    "to_chrome_trace_by_process",
    "traces_from_dict",
    "traces_to_dict",
    "write_chrome_trace",
]

RESERVED_ARG = "_kvflow"
PidMode = Literal["request", "process"]


def to_chrome_trace(
    traces: Iterable[RequestTrace], *, pid_per: PidMode = "request"
) -> dict[str, Any]:
    """The Chrome/Perfetto JSON document of ``traces`` (a new dict; inputs untouched).

    ``pid_per="request"`` gives each request its own process row (named ``req <id>``) with one
    thread per stage lane; ``"process"`` puts every request in pid 1, one thread per stage.
    Exactly one ``ph: "X"`` event per span; ``ph: "M"`` metadata events name the rows.
    """
    if pid_per not in ("request", "process"):
        raise ValueError(f"pid_per must be 'request' or 'process', got {pid_per!r}")
    traces = list(traces)
    starts = [span.start_s for trace in traces for span in trace.spans]
    origin = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    tids: dict[str, int] = {}
    named_threads: set[tuple[int, int]] = set()
    for index, trace in enumerate(traces):
        pid = index + 1 if pid_per == "request" else 1
        if pid_per == "request" or index == 0:
            label = f"req {trace.request_id}" if pid_per == "request" else "kvflow"
            events.append(_meta("process_name", pid, 0, {"name": label}))
        events.append(_request_meta(trace, pid))
        for span in trace.spans:
            lane = span.stage or span.name
            tid = tids.setdefault(lane, len(tids) + 1)
            if (pid, tid) not in named_threads:
                named_threads.add((pid, tid))
                events.append(_meta("thread_name", pid, tid, {"name": lane}))
            events.append(_span_event(trace.request_id, span, pid, tid, origin))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "kvflow", "origin_s": origin},
    }


SPAN_ID_STRIDE = 1_000_000  # span ids of the k-th process row start at k * stride


@dataclass(frozen=True)
class ProcessTraces:
    """One process's traces for a merged document. ``shift_s`` is added to every span time
    to put them on a common clock (e.g. wall time: ``time.time() - time.monotonic()`` of
    that process)."""

    name: str
    traces: tuple[RequestTrace, ...]
    shift_s: float = 0.0


def to_chrome_trace_by_process(rows: Iterable[ProcessTraces]) -> dict[str, Any]:
    """One Chrome/Perfetto document of requests whose spans were recorded in several
    processes (a router and the nodes it called): one process row per process, one thread
    per stage lane. ``from_chrome_trace`` reads it back as one trace per request with the
    spans of every process (span ids of the k-th row are offset by k * SPAN_ID_STRIDE)."""
    rows = list(rows)
    starts = [s.start_s + row.shift_s for row in rows for tr in row.traces for s in tr.spans]
    origin = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    described: set[str] = set()
    for k, row in enumerate(rows):
        pid = k + 1
        events.append(_meta("process_name", pid, 0, {"name": row.name}))
        tids: dict[str, int] = {}
        for trace in row.traces:
            if trace.request_id not in described:
                described.add(trace.request_id)
                events.append(_request_meta(trace, pid))
            for span in trace.spans:
                lane = span.stage or span.name
                if lane not in tids:
                    tids[lane] = len(tids) + 1
                    events.append(_meta("thread_name", pid, tids[lane], {"name": lane}))
                shifted = Span(
                    name=span.name,
                    start_s=span.start_s + row.shift_s,
                    duration_s=span.duration_s,
                    attrs={**span.attrs, "process": row.name},
                    parent=None if span.parent is None else span.parent + k * SPAN_ID_STRIDE,
                    span_id=span.span_id + k * SPAN_ID_STRIDE,
                    stage=span.stage,
                )
                events.append(_span_event(trace.request_id, shifted, pid, tids[lane], origin))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "kvflow", "origin_s": origin},
    }


def from_chrome_trace(document: Mapping[str, Any]) -> list[RequestTrace]:
    """Read ``RequestTrace`` objects back from a document made by ``to_chrome_trace``.

    Events without the reserved ``"_kvflow"`` entry (e.g. from other producers) are read as
    stage spans of a request named after their pid. Raises ValueError if ``document`` has no
    ``traceEvents`` list.
    """
    events = document.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace document: no 'traceEvents' list")
    other = document.get("otherData")
    origin = float(other.get("origin_s", 0.0)) if isinstance(other, Mapping) else 0.0
    order: list[str] = []
    spans: dict[str, list[Span]] = {}
    info: dict[str, Mapping[str, Any]] = {}
    for event in events:
        if not isinstance(event, Mapping):
            raise ValueError(f"trace event is not an object: {event!r}")
        meta = _reserved(event)
        if event.get("ph") == "M" and event.get("name") == "kvflow_request":
            rid = str(meta.get("request_id", event.get("pid")))
            info[rid] = meta
            if rid not in spans:
                order.append(rid)
                spans[rid] = []
        elif event.get("ph") == "X":
            rid = str(meta.get("request_id", f"pid-{event.get('pid')}"))
            if rid not in spans:
                order.append(rid)
                spans[rid] = []
            spans[rid].append(_span_from_event(event, meta, origin))
    return [
        RequestTrace(
            request_id=rid,
            spans=tuple(spans[rid]),
            status=TraceStatus(info.get(rid, {}).get("status", "ok")),
            error=info.get(rid, {}).get("error"),
            attrs=dict(info.get(rid, {}).get("attrs") or {}),
        )
        for rid in order
    ]


def write_chrome_trace(
    traces: Iterable[RequestTrace], path: str | Path, *, pid_per: PidMode = "request"
) -> int:
    """Write ``to_chrome_trace(traces)`` to ``path`` as strict JSON; returns the span count."""
    document = to_chrome_trace(traces, pid_per=pid_per)
    Path(path).write_text(json.dumps(document, allow_nan=False), encoding="utf-8")
    return sum(1 for event in document["traceEvents"] if event["ph"] == "X")


def load_traces(path: str | Path) -> list[RequestTrace]:
    """Read a trace file: a Chrome trace (``write_chrome_trace``) or the native JSON form.

    Raises ValueError naming the file when it is neither.
    """
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(document, Mapping):
        raise ValueError(f"{path}: a trace file holds a JSON object")
    try:
        if "traceEvents" in document:
            return from_chrome_trace(document)
        return traces_from_dict(document)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


@dataclass(frozen=True)
class StageStats:
    """Latency of one stage (or child span path) over many requests, in milliseconds."""

    stage: str
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile: the ``ceil(pct/100 * n)``-th smallest value (an observed one).

    ``sorted_values`` must be sorted ascending and non-empty; ``0 < pct <= 100``.
    """
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    if not 0 < pct <= 100:
        raise ValueError(f"pct must be in (0, 100], got {pct!r}")
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values) - 1e-9))
    return sorted_values[rank - 1]


def stage_breakdown(
    source: Iterable[RequestTrace] | Mapping[str, Any], *, include_children: bool = False
) -> list[StageStats]:
    """Per-stage latency over ``source``: traces, a Chrome trace dict, or a native trace dict.

    Rows are the top-level spans grouped by name, in order of first appearance; with
    ``include_children`` every child span is a row too, named by its path
    (``prefill/kv_write``). Percentiles are nearest-rank (see ``percentile``).
    """
    if isinstance(source, Mapping):
        traces = from_chrome_trace(source) if "traceEvents" in source else traces_from_dict(source)
    else:
        traces = list(source)
    durations: dict[str, list[float]] = {}
    for trace in traces:
        for span in trace.spans:
            if span.parent is None:
                key = span.name
            elif include_children:
                key = trace.span_path(span)
            else:
                continue
            durations.setdefault(key, []).append(span.duration_s * 1000.0)
    rows = []
    for key, values in durations.items():
        values.sort()
        rows.append(
            StageStats(
                stage=key,
                count=len(values),
                p50_ms=percentile(values, 50),
                p90_ms=percentile(values, 90),
                p99_ms=percentile(values, 99),
                mean_ms=sum(values) / len(values),
                max_ms=values[-1],
            )
        )
    return rows


def format_breakdown(rows: Iterable[StageStats]) -> str:
    """A fixed-width text table of ``rows`` (one line per stage, a header line first)."""
    rows = list(rows)
    if not rows:
        return "no spans"
    width = max(len("stage"), *(len(row.stage) for row in rows))
    header = (
        f"{'stage':<{width}}  {'count':>7}  {'p50 ms':>10}  {'p90 ms':>10}  "
        f"{'p99 ms':>10}  {'mean ms':>10}  {'max ms':>10}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.stage:<{width}}  {row.count:>7d}  {row.p50_ms:>10.3f}  {row.p90_ms:>10.3f}  "
            f"{row.p99_ms:>10.3f}  {row.mean_ms:>10.3f}  {row.max_ms:>10.3f}"
        )
    return "\n".join(lines)


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _request_meta(trace: RequestTrace, pid: int) -> dict[str, Any]:
    info = {
        "request_id": trace.request_id,
        "status": str(trace.status),
        "error": trace.error,
        "attrs": json_safe(dict(trace.attrs)),
    }
    return _meta("kvflow_request", pid, 0, {RESERVED_ARG: info})


def _span_event(request_id: str, span: Span, pid: int, tid: int, origin: float) -> dict[str, Any]:
    args = {str(k): json_safe(v) for k, v in span.attrs.items() if k != RESERVED_ARG}
    args[RESERVED_ARG] = {
        "request_id": request_id,
        "span_id": span.span_id,
        "parent": span.parent,
        "stage": span.stage,
    }
    return {
        "name": span.name,
        "cat": "stage" if span.parent is None else "span",
        "ph": "X",
        "ts": (span.start_s - origin) * 1e6,
        "dur": span.duration_s * 1e6,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def _reserved(event: Mapping[str, Any]) -> Mapping[str, Any]:
    args = event.get("args")
    if isinstance(args, Mapping):
        meta = args.get(RESERVED_ARG)
        if isinstance(meta, Mapping):
            return meta
    return {}


def _span_from_event(event: Mapping[str, Any], meta: Mapping[str, Any], origin: float) -> Span:
    try:
        args = event.get("args") or {}
        attrs = {k: v for k, v in args.items() if k != RESERVED_ARG}
        parent = meta.get("parent")
        return Span(
            name=str(event["name"]),
            start_s=origin + float(event["ts"]) / 1e6,
            duration_s=float(event.get("dur", 0.0)) / 1e6,
            attrs=attrs,
            parent=None if parent is None else int(parent),
            span_id=int(meta.get("span_id", 0)),
            stage=str(meta.get("stage") or event["name"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad trace event {dict(event)!r}: {exc!r}") from exc
