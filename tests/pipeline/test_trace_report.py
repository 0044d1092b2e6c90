"""kvflow.tools.trace_report: the library side of `kvflow trace export|report`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.pipeline import FunctionStage, Pipeline, RequestContext
from kvflow.tools.trace_report import export_file, report_file

from .conftest import FakeClock, run_async


def test_export_then_report_a_pipeline_run(tmp_path: Path) -> None:
    clock = FakeClock(0.0)
    durations = {"tokenize": 0.001, "prefill": 0.040, "decode": 0.200}

    def timed(name: str) -> FunctionStage:
        async def run(ctx: RequestContext[Any]) -> None:
            await asyncio.sleep(0)
            clock.advance(durations[name] * (1 + int(ctx.request_id[1:]) % 2))

        return FunctionStage(name, run, concurrency=1)

    async def main() -> Pipeline:
        async with Pipeline([timed(n) for n in durations]) as pipe:
            for i in range(10):
                await (await pipe.submit(RequestContext(f"r{i}", clock=clock))).result()
        return pipe

    pipe = run_async(main())
    path = tmp_path / "trace.json"
    assert export_file(pipe.tracer.traces(), path) == 30
    assert len(json.loads(path.read_text())["traceEvents"]) > 30
    report = report_file(path)
    lines = report.splitlines()
    assert lines[0] == f"10 requests (0 not ok) from {path}"
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:]}
    assert list(rows) == ["tokenize", "prefill", "decode"]
    # half the requests take d, half 2d: p50 = d, p90 = p99 = 2d
    assert rows["prefill"][:4] == ["10", "40.000", "80.000", "80.000"]
    assert rows["decode"][:4] == ["10", "200.000", "400.000", "400.000"]


def test_report_names_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"x\.json"):
        report_file(path)
