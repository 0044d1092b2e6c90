"""Bounded queues: submit waits, try_submit refuses, a full inner queue holds the stage back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvflow.pipeline import (
    FunctionStage,
    Metrics,
    Overloaded,
    Pipeline,
    PipelineConfig,
    RequestContext,
)

from .conftest import run_async, spin


def test_try_submit_raises_overloaded_and_submit_waits_when_first_queue_full() -> None:
    gate = asyncio.Event()
    started: list[str] = []

    async def work(ctx: RequestContext[Any]) -> None:
        started.append(ctx.request_id)
        await gate.wait()

    async def main() -> None:
        metrics = Metrics()
        config = PipelineConfig(queue_size=2, default_concurrency=1)
        async with Pipeline([FunctionStage("s", work)], config, metrics=metrics) as pipe:
            h0 = pipe.try_submit(RequestContext("r0"))
            await spin()  # r0 taken by the only worker
            h1 = pipe.try_submit(RequestContext("r1"))
            h2 = pipe.try_submit(RequestContext("r2"))
            assert pipe.queue_depths() == {"s": 2}
            refused = RequestContext("r3")
            with pytest.raises(Overloaded) as info:
                pipe.try_submit(refused)
            assert info.value.queue_size == 2
            assert refused._owner is None  # untouched: may be submitted later
            blocked = asyncio.create_task(pipe.submit(RequestContext("r4")))
            await spin()
            assert not blocked.done()  # backpressure: waits for room
            assert 'kvflow_pipeline_queue_depth{stage="s"} 2.0' in metrics.render().decode()
            gate.set()
            h4 = await blocked
            for handle in (h0, h1, h2, h4):
                await handle.result()
        assert started == ["r0", "r1", "r2", "r4"]
        text = metrics.render().decode()
        assert "kvflow_pipeline_overloaded_total 1.0" in text
        assert 'kvflow_pipeline_requests_total{status="ok"} 4.0' in text

    run_async(main())


def test_full_queue_between_stages_holds_back_the_upstream_stage() -> None:
    """With the downstream stage stuck, upstream finishes at most (queue_size + 1) more."""
    gate = asyncio.Event()
    upstream_done: list[str] = []

    async def up(ctx: RequestContext[Any]) -> None:
        upstream_done.append(ctx.request_id)

    async def down(ctx: RequestContext[Any]) -> None:
        await gate.wait()

    async def main() -> None:
        config = PipelineConfig(queue_size=1, default_concurrency=1)
        stages = [FunctionStage("up", up), FunctionStage("down", down)]
        async with Pipeline(stages, config) as pipe:
            tasks = [asyncio.create_task(pipe.submit(RequestContext(f"r{i}"))) for i in range(6)]
            await spin(50)
            # r0 inside down, r1 in the down queue, r2 done upstream and waiting to put.
            assert upstream_done == ["r0", "r1", "r2"]
            assert pipe.queue_depths() == {"up": 1, "down": 1}
            assert sum(task.done() for task in tasks) == 4  # r3 queued; r4, r5 still waiting
            gate.set()
            for task in tasks:
                await (await task).result()
        assert upstream_done == [f"r{i}" for i in range(6)]

    run_async(main())
