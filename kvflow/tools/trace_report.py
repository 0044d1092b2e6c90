"""Library helpers behind ``kvflow trace export|report`` (the CLI wiring lives elsewhere)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvflow.pipeline import (
    RequestTrace,
    format_breakdown,
    load_traces,
    stage_breakdown,
    write_chrome_trace,
)


def report_file(path: str | Path, *, include_children: bool = False) -> str:
    """The per-stage latency table (count, p50/p90/p99, mean, max in ms) of a trace file.

    ``path`` is a Chrome/Perfetto trace written by ``export_file`` (or the native JSON form).
    Raises ValueError naming the file if it is not a trace file, OSError if unreadable.
    """
    traces = load_traces(path)
    table = format_breakdown(stage_breakdown(traces, include_children=include_children))
    failed = sum(1 for trace in traces if trace.status != "ok")
    return f"{len(traces)} requests ({failed} not ok) from {path}\n{table}"


def export_file(traces: Iterable[RequestTrace], path: str | Path) -> int:
    """Write ``traces`` to ``path`` as a Chrome/Perfetto trace; returns the number of spans."""
    return write_chrome_trace(traces, path)
