"""The happy path: stages in order, overlap between requests, output streaming, spans."""

from __future__ import annotations

import asyncio
import gc
import warnings
from typing import Any

import pytest

from kvflow.pipeline import (
    FunctionStage,
    Pipeline,
    PipelineConfig,
    RequestCancelled,
    RequestContext,
    Stage,
    TraceStatus,
)

from .conftest import run_async, spin


class Record(Stage):
    """Appends its name to ctx.state.path and emits it."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def run(self, ctx: RequestContext[Any]) -> None:
        ctx.state.path.append(self.name)
        ctx.emit(self.name)


def new_ctx(rid: str, **kwargs: Any) -> RequestContext[Any]:
    ctx: RequestContext[Any] = RequestContext(rid, **kwargs)
    ctx.state.path = []
    return ctx


def test_stages_run_in_order_and_result_returns_context() -> None:
    async def main() -> None:
        async with Pipeline([Record("a"), Record("b"), Record("c")]) as pipe:
            handle = await pipe.submit(new_ctx("r1"))
            items = [item async for item in handle]
            ctx = await handle.result()
        assert items == ["a", "b", "c"]
        assert ctx.state.path == ["a", "b", "c"]
        assert handle.done() and handle.error is None
        assert handle.trace is not None and handle.trace.status is TraceStatus.OK

    run_async(main())


def test_stages_of_different_requests_overlap() -> None:
    """r1 waits inside stage B until r2 is inside stage A, and r2 waits for r1 in B."""
    r1_in_b = asyncio.Event()
    r2_in_a = asyncio.Event()
    log: list[tuple[str, str, str]] = []

    async def stage_a(ctx: RequestContext[Any]) -> None:
        log.append(("enter", "A", ctx.request_id))
        if ctx.request_id == "r2":
            r2_in_a.set()
            await r1_in_b.wait()
        log.append(("exit", "A", ctx.request_id))

    async def stage_b(ctx: RequestContext[Any]) -> None:
        log.append(("enter", "B", ctx.request_id))
        if ctx.request_id == "r1":
            r1_in_b.set()
            await r2_in_a.wait()
        log.append(("exit", "B", ctx.request_id))

    async def main() -> None:
        stages = [FunctionStage("A", stage_a, concurrency=1), FunctionStage("B", stage_b)]
        async with Pipeline(stages) as pipe:
            h1 = await pipe.submit(new_ctx("r1"))
            await r1_in_b.wait()
            h2 = await pipe.submit(new_ctx("r2"))
            await asyncio.gather(h1.result(), h2.result())
        # r2 entered A before r1 left B: both were inside a stage at once.
        assert log.index(("enter", "A", "r2")) < log.index(("exit", "B", "r1"))
        spans1 = {s.name: s for s in h1.trace.stage_spans()}  # type: ignore[union-attr]
        spans2 = {s.name: s for s in h2.trace.stage_spans()}  # type: ignore[union-attr]
        assert spans2["A"].start_s < spans1["B"].end_s

    run_async(main())


def test_concurrency_limit_caps_requests_inside_a_stage() -> None:
    inside = 0
    peak = 0
    release = asyncio.Event()

    async def slow(ctx: RequestContext[Any]) -> None:
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        await release.wait()
        inside -= 1

    async def main() -> None:
        config = PipelineConfig(stage_concurrency={"slow": 3})
        async with Pipeline([FunctionStage("slow", slow, concurrency=1)], config) as pipe:
            handles = [await pipe.submit(new_ctx(f"r{i}")) for i in range(8)]
            await spin()
            assert inside == 3
            release.set()
            for handle in handles:
                await handle.result()
        assert peak == 3
        assert pipe.limits == (3,)

    run_async(main())


def test_emitted_items_stream_in_order_while_stage_runs() -> None:
    gate = asyncio.Event()

    async def produce(ctx: RequestContext[Any]) -> None:
        for i in range(5):
            ctx.emit(i)
        await gate.wait()
        for i in range(5, 10):
            ctx.emit(i)

    async def main() -> None:
        async with Pipeline([FunctionStage("decode", produce)]) as pipe:
            handle = await pipe.submit(RequestContext("r"))
            received = []
            async for item in handle:
                received.append(item)
                if item == 4:
                    assert not handle.done()  # streamed before the stage finished
                    gate.set()
            await handle.result()
        assert received == list(range(10))

    run_async(main())


def test_emit_from_an_engine_thread_keeps_order() -> None:
    async def produce(ctx: RequestContext[Any]) -> None:
        def engine() -> None:
            for i in range(200):
                ctx.emit(i)

        await asyncio.to_thread(engine)

    async def main() -> None:
        async with Pipeline([FunctionStage("decode", produce)]) as pipe:
            handle = await pipe.submit(RequestContext("r"))
            received = [item async for item in handle]
        assert received == list(range(200))

    run_async(main())


def test_spans_for_every_stage_with_attrs_and_child_spans() -> None:
    async def load(ctx: RequestContext[Any]) -> None:
        ctx.set_attr("blocks_hit", 3)
        with ctx.span("kvdb_get", tier="dram") as span:
            span.set_attr("bytes", 4096)
            with ctx.span("decompress"):
                ctx.set_attr("bytes_moved", 4096)  # goes to the stage span, not the child

    async def main() -> None:
        stages = [Record("tokenize"), FunctionStage("reuse-load", load), Record("decode")]
        async with Pipeline(stages) as pipe:
            handle = await pipe.submit(new_ctx("r"))
            await handle.result()
        trace = pipe.tracer.find("r")
        assert trace is not None and trace is handle.trace
        names = [s.name for s in trace.spans]
        assert names == ["tokenize", "reuse-load", "kvdb_get", "decompress", "decode"]
        by_name = {s.name: s for s in trace.spans}
        stage = by_name["reuse-load"]
        assert stage.parent is None
        assert stage.attrs["blocks_hit"] == 3 and stage.attrs["bytes_moved"] == 4096
        assert "queued_ms" in stage.attrs
        child = by_name["kvdb_get"]
        assert child.parent == stage.span_id and child.stage == "reuse-load"
        assert dict(child.attrs) == {"tier": "dram", "bytes": 4096}
        assert by_name["decompress"].parent == child.span_id
        assert trace.span_path(by_name["decompress"]) == "reuse-load/kvdb_get/decompress"
        assert stage.start_s <= child.start_s <= child.end_s <= stage.end_s

    run_async(main())


def test_background_stage_overlaps_the_next_stage_and_is_joined() -> None:
    """stream (background) consumes chunks that prefill produces while prefill still runs."""
    log: list[str] = []

    async def stream(ctx: RequestContext[Any]) -> None:
        while True:
            chunk = await ctx.state.chunks.get()
            if chunk is None:
                return
            log.append(f"stream {chunk}")
            ctx.state.acks.put_nowait(chunk)

    async def prefill(ctx: RequestContext[Any]) -> None:
        for chunk in range(3):
            log.append(f"prefill {chunk}")
            ctx.state.chunks.put_nowait(chunk)
            assert await ctx.state.acks.get() == chunk  # only possible if stream runs now
        ctx.state.chunks.put_nowait(None)

    async def decode(ctx: RequestContext[Any]) -> None:
        await ctx.join("stream")
        log.append("decode")

    async def main() -> None:
        stages = [
            FunctionStage("stream", stream, background=True),
            FunctionStage("prefill", prefill),
            FunctionStage("decode", decode),
        ]
        async with Pipeline(stages) as pipe:
            ctx = new_ctx("r")
            ctx.state.chunks = asyncio.Queue()
            ctx.state.acks = asyncio.Queue()
            handle = await pipe.submit(ctx)
            await handle.result()
        assert log == [
            "prefill 0", "stream 0", "prefill 1", "stream 1", "prefill 2", "stream 2", "decode",
        ]  # fmt: skip
        spans = {s.name: s for s in handle.trace.stage_spans()}  # type: ignore[union-attr]
        assert spans["stream"].attrs["background"] is True
        assert spans["stream"].start_s <= spans["prefill"].start_s
        assert spans["stream"].end_s >= spans["prefill"].end_s - 1e-9

    run_async(main())


def test_request_waits_for_unjoined_children() -> None:
    finished = asyncio.Event()

    async def spawner(ctx: RequestContext[Any]) -> None:
        async def child() -> None:
            await asyncio.sleep(0.01)
            finished.set()

        ctx.spawn("side", child())

    async def main() -> None:
        async with Pipeline([FunctionStage("s", spawner)]) as pipe:
            handle = await pipe.submit(RequestContext("r"))
            await handle.result()
            assert finished.is_set()
        assert [s.name for s in handle.trace.spans] == ["s", "side"]  # type: ignore[union-attr]

    run_async(main())


def test_many_requests_all_complete_and_traces_are_kept() -> None:
    async def step(ctx: RequestContext[Any]) -> None:
        await asyncio.sleep(0)
        ctx.state.path.append(ctx.request_id)

    async def main() -> None:
        config = PipelineConfig(queue_size=4, default_concurrency=2, trace_capacity=16)
        stages = [FunctionStage(f"s{i}", step) for i in range(4)]
        async with Pipeline(stages, config) as pipe:
            handles = [await pipe.submit(new_ctx(f"r{i}")) for i in range(40)]
            contexts = await asyncio.gather(*(h.result() for h in handles))
            assert pipe.in_flight() == 0
        assert all(len(ctx.state.path) == 4 for ctx in contexts)
        assert len(pipe.tracer) == 16 and pipe.tracer.dropped == 24

    run_async(main())


def test_pipeline_rejects_bad_stage_lists() -> None:
    async def noop(ctx: RequestContext[Any]) -> None:
        return None

    with pytest.raises(ValueError, match="at least one"):
        Pipeline([])
    with pytest.raises(ValueError, match="duplicate stage name 'a'"):
        Pipeline([FunctionStage("a", noop), FunctionStage("a", noop)])
    with pytest.raises(TypeError, match=r"stages\[0\]"):
        Pipeline([object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="concurrency"):
        FunctionStage("a", noop, concurrency=0)


def test_background_task_cancelled_before_its_first_step_gives_its_slot_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request failed between a background stage's spawn and its task's first step (a client
    that disconnects in the same loop turn) never runs the stage: its concurrency slot still
    comes back, and the never-started coroutine is closed, not left to warn "never awaited"."""
    spawn = RequestContext.spawn

    def spawn_then_lose_the_race(
        self: RequestContext[Any], name: str, coro: Any
    ) -> asyncio.Task[Any]:
        task = spawn(self, name, coro)
        if self.request_id == "lost":
            self.cancel("client gone")  # on the loop, before the loop runs the task
        return task

    monkeypatch.setattr(RequestContext, "spawn", spawn_then_lose_the_race)
    ran: list[str] = []

    async def stream(ctx: RequestContext[Any]) -> None:
        ran.append(ctx.request_id)

    async def main() -> None:
        stages = [FunctionStage("stream", stream, background=True, concurrency=1)]
        async with Pipeline(stages) as pipe:
            lost = await pipe.submit(new_ctx("lost"))
            with pytest.raises(RequestCancelled, match="client gone"):
                await asyncio.wait_for(lost.result(), 30)
            kept = await pipe.submit(new_ctx("kept"))
            await asyncio.wait_for(kept.result(), 30)  # the one slot came back

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        run_async(main())
        gc.collect()
    assert ran == ["kept"]
