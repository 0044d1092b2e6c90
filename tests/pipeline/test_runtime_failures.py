"""Errors, deadlines, cancellation, cleanup and shutdown."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kvflow.pipeline import (
    DeadlineExceeded,
    FinalError,
    FunctionStage,
    Metrics,
    Pipeline,
    PipelineClosed,
    PipelineConfig,
    RequestCancelled,
    RequestContext,
    Stage,
    StageError,
    TraceStatus,
)

from .conftest import FakeClock, run_async, spin


class Tracked(Stage):
    """A stage that records run/cleanup calls in a shared log; may block or raise."""

    def __init__(
        self,
        name: str,
        log: list[tuple[str, ...]],
        *,
        block: asyncio.Event | None = None,
        entered: asyncio.Event | None = None,
        raises: BaseException | None = None,
    ) -> None:
        self.name = name
        self.log = log
        self.block = block
        self.entered = entered
        self.raises = raises

    async def run(self, ctx: RequestContext[Any]) -> None:
        self.log.append(("run", self.name))
        if self.entered is not None:
            self.entered.set()
        if self.block is not None:
            await self.block.wait()
        if self.raises is not None:
            raise self.raises

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        self.log.append(("cleanup", self.name, type(error).__name__ if error else "None"))


class Rejected(FinalError):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__("no capacity")
        self.retry_after_s = retry_after_s


def test_exception_in_stage_is_stage_error_naming_it_with_cause() -> None:
    log: list[tuple[str, ...]] = []
    boom = KeyError("page 7")

    async def main() -> None:
        stages = [Tracked("a", log), Tracked("b", log, raises=boom), Tracked("c", log)]
        metrics = Metrics()
        async with Pipeline(stages, metrics=metrics) as pipe:
            handle = await pipe.submit(RequestContext("r1"))
            with pytest.raises(StageError) as info:
                await handle.result()
            with pytest.raises(StageError):
                _ = [item async for item in handle]
        err = info.value
        assert err.stage == "b" and err.request_id == "r1"
        assert err.cause is boom and err.__cause__ is boom
        assert "'b'" in str(err) and "KeyError" in str(err)
        assert log == [("run", "a"), ("run", "b"), ("cleanup", "b", "StageError"),
                       ("cleanup", "a", "StageError")]  # fmt: skip
        trace = handle.trace
        assert trace is not None and trace.status is TraceStatus.ERROR
        assert [s.name for s in trace.spans] == ["a", "b"]
        assert trace.spans[1].attrs["error"] == "KeyError"
        text = metrics.render().decode()
        assert 'kvflow_pipeline_stage_errors_total{stage="b",type="KeyError"} 1.0' in text
        assert 'kvflow_pipeline_requests_total{status="error"} 1.0' in text

    run_async(main())


def test_final_error_passes_through_unwrapped_with_stage() -> None:
    async def route(ctx: RequestContext[Any]) -> None:
        raise Rejected(retry_after_s=0.5)

    async def main() -> None:
        async with Pipeline([FunctionStage("route", route)]) as pipe:
            handle = await pipe.submit(RequestContext("r"))
            with pytest.raises(Rejected) as info:
                await handle.result()
        assert info.value.stage == "route" and info.value.request_id == "r"
        assert info.value.retry_after_s == 0.5

    run_async(main())


def test_deadline_mid_stage_names_the_stage_and_cleans_up() -> None:
    log: list[tuple[str, ...]] = []
    never = asyncio.Event()

    async def main() -> None:
        stages = [Tracked("fast", log), Tracked("slow", log, block=never), Tracked("end", log)]
        async with Pipeline(stages) as pipe:
            handle = await pipe.submit(RequestContext("r", timeout_s=0.05))
            with pytest.raises(DeadlineExceeded) as info:
                await handle.result()
        assert info.value.stage == "slow" and not info.value.queued
        assert log == [("run", "fast"), ("run", "slow"), ("cleanup", "slow", "DeadlineExceeded"),
                       ("cleanup", "fast", "DeadlineExceeded")]  # fmt: skip
        assert handle.trace is not None and handle.trace.status is TraceStatus.DEADLINE

    run_async(main())


def test_deadline_checked_with_injected_clock_at_stage_entry() -> None:
    log: list[tuple[str, ...]] = []
    clock = FakeClock()

    async def tick(ctx: RequestContext[Any]) -> None:
        clock.advance(5.0)  # the stage "takes" 5 s of the fake clock

    async def main() -> None:
        stages = [FunctionStage("tick", tick), Tracked("after", log)]
        config = PipelineConfig(default_deadline_s=3600.0)
        async with Pipeline(stages, config) as pipe:
            ctx = RequestContext("r", clock=clock, deadline=clock.now + 2.0)
            handle = await pipe.submit(ctx)
            with pytest.raises(DeadlineExceeded) as info:
                await handle.result()
            assert ctx.deadline == clock.now - 3.0  # explicit deadline kept over the default
        assert info.value.stage == "after" and info.value.queued
        assert log == []  # never entered, so never cleaned up
        assert handle.trace is not None
        tick_span = handle.trace.spans[0]
        assert tick_span.duration_s == 5.0

    run_async(main())


def test_checkpoint_raises_deadline_with_current_stage() -> None:
    clock = FakeClock()

    async def poll(ctx: RequestContext[Any]) -> None:
        ctx.checkpoint()
        clock.advance(10.0)
        ctx.checkpoint()

    async def main() -> None:
        async with Pipeline([FunctionStage("poll", poll)]) as pipe:
            handle = await pipe.submit(RequestContext("r", clock=clock, timeout_s=1.0))
            with pytest.raises(DeadlineExceeded) as info:
                await handle.result()
        assert info.value.stage == "poll" and info.value.request_id == "r"

    run_async(main())


def test_default_deadline_applies_when_context_has_none() -> None:
    never = asyncio.Event()

    async def main() -> None:
        config = PipelineConfig(default_deadline_s=0.02)
        async with Pipeline([Tracked("wait", [], block=never)], config) as pipe:
            ctx = RequestContext("r")
            handle = await pipe.submit(ctx)
            assert ctx.deadline is not None
            with pytest.raises(DeadlineExceeded):
                await handle.result()

    run_async(main())


def test_cancel_mid_stage_cleans_up_entered_stages_in_reverse_order() -> None:
    log: list[tuple[str, ...]] = []
    entered = asyncio.Event()
    never = asyncio.Event()

    async def main() -> None:
        stages = [
            Tracked("tokenize", log),
            Tracked("hash", log),
            Tracked("prefill", log, block=never, entered=entered),
            Tracked("decode", log),
        ]
        async with Pipeline(stages) as pipe:
            handle = await pipe.submit(RequestContext("r"))
            await entered.wait()
            assert handle.cancel("client went away")
            assert not handle.cancel("again")
            with pytest.raises(RequestCancelled) as info:
                await handle.result()
        assert info.value.stage == "prefill" and info.value.reason == "client went away"
        assert log == [
            ("run", "tokenize"), ("run", "hash"), ("run", "prefill"),
            ("cleanup", "prefill", "RequestCancelled"), ("cleanup", "hash", "RequestCancelled"),
            ("cleanup", "tokenize", "RequestCancelled"),
        ]  # fmt: skip
        trace = handle.trace
        assert trace is not None and trace.status is TraceStatus.CANCELLED
        assert trace.spans[-1].attrs["error"] == "CancelledError"

    run_async(main())


def test_cancel_from_another_thread() -> None:
    entered = asyncio.Event()
    never = asyncio.Event()

    async def main() -> None:
        async with Pipeline([Tracked("s", [], block=never, entered=entered)]) as pipe:
            handle = await pipe.submit(RequestContext("r"))
            await entered.wait()
            thread = threading.Thread(target=handle.cancel, args=("from thread",))
            thread.start()
            with pytest.raises(RequestCancelled, match="from thread"):
                await handle.result()
            thread.join()

    run_async(main())


def test_cancel_while_queued_ends_at_once_without_entering() -> None:
    log: list[tuple[str, ...]] = []
    entered = asyncio.Event()
    gate = asyncio.Event()

    async def main() -> None:
        config = PipelineConfig(default_concurrency=1)
        async with Pipeline([Tracked("only", log, block=gate, entered=entered)], config) as pipe:
            first = await pipe.submit(RequestContext("first"))
            await entered.wait()
            second = await pipe.submit(RequestContext("second"))
            second.cancel("not needed")
            with pytest.raises(RequestCancelled) as info:
                await second.result()
            assert not first.done()  # ended while the only worker was still busy
            gate.set()
            await first.result()
        assert info.value.stage == "only"
        assert log == [("run", "only"), ("cleanup", "only", "None")]

    run_async(main())


def test_context_cancelled_before_submit_never_runs() -> None:
    log: list[tuple[str, ...]] = []

    async def main() -> None:
        async with Pipeline([Tracked("a", log)]) as pipe:
            ctx = RequestContext("r")
            ctx.cancel("early")
            handle = await pipe.submit(ctx)
            with pytest.raises(RequestCancelled, match="early"):
                await handle.result()
        assert log == []

    run_async(main())


def test_cleanup_runs_on_success_with_none_and_survives_failing_hooks() -> None:
    log: list[str] = []

    async def ok(ctx: RequestContext[Any]) -> None:
        log.append("run")

    async def bad_cleanup(ctx: RequestContext[Any], error: BaseException | None) -> None:
        raise RuntimeError("cleanup bug")

    async def slow_cleanup(ctx: RequestContext[Any], error: BaseException | None) -> None:
        await asyncio.Event().wait()

    async def good_cleanup(ctx: RequestContext[Any], error: BaseException | None) -> None:
        log.append(f"cleanup {error}")

    async def main() -> None:
        metrics = Metrics()
        stages = [
            FunctionStage("a", ok, cleanup=good_cleanup),
            FunctionStage("b", ok, cleanup=slow_cleanup),
            FunctionStage("c", ok, cleanup=bad_cleanup),
        ]
        config = PipelineConfig(cleanup_timeout_s=0.02)
        async with Pipeline(stages, config, metrics=metrics) as pipe:
            handle = await pipe.submit(RequestContext("r"))
            await handle.result()
        assert log == ["run", "run", "run", "cleanup None"]
        text = metrics.render().decode()
        assert 'kvflow_pipeline_cleanup_errors_total{stage="b"} 1.0' in text
        assert 'kvflow_pipeline_cleanup_errors_total{stage="c"} 1.0' in text

    run_async(main())


def test_failing_background_stage_fails_request_and_cancels_foreground() -> None:
    log: list[tuple[str, ...]] = []
    entered = asyncio.Event()
    never = asyncio.Event()

    async def stream(ctx: RequestContext[Any]) -> None:
        await entered.wait()
        raise ConnectionError("decode node gone")

    async def stream_cleanup(ctx: RequestContext[Any], error: BaseException | None) -> None:
        log.append(("cleanup", "stream", type(error).__name__))

    async def main() -> None:
        stages = [
            FunctionStage("stream", stream, cleanup=stream_cleanup, background=True),
            Tracked("prefill", log, block=never, entered=entered),
        ]
        async with Pipeline(stages) as pipe:
            handle = await pipe.submit(RequestContext("r"))
            with pytest.raises(StageError) as info:
                await handle.result()
        assert info.value.stage == "stream"
        assert isinstance(info.value.cause, ConnectionError)
        assert log == [("run", "prefill"), ("cleanup", "prefill", "StageError"),
                       ("cleanup", "stream", "StageError")]  # fmt: skip

    run_async(main())


def test_failing_spawned_child_names_the_child() -> None:
    async def spawner(ctx: RequestContext[Any]) -> None:
        async def child() -> None:
            raise ValueError("bad chunk")

        ctx.spawn("kv-writer", child())
        await asyncio.Event().wait()

    async def main() -> None:
        async with Pipeline([FunctionStage("prefill", spawner)]) as pipe:
            handle = await pipe.submit(RequestContext("r"))
            with pytest.raises(StageError) as info:
                await handle.result()
        assert info.value.stage == "kv-writer"

    run_async(main())


def test_stop_without_drain_fails_in_flight_with_pipeline_closed() -> None:
    log: list[tuple[str, ...]] = []
    entered = asyncio.Event()
    never = asyncio.Event()

    async def main() -> None:
        config = PipelineConfig(default_concurrency=1, queue_size=1)
        pipe = Pipeline([Tracked("s", log, block=never, entered=entered)], config)
        await pipe.start()
        running = await pipe.submit(RequestContext("running"))
        await entered.wait()
        queued = await pipe.submit(RequestContext("queued"))
        blocked = asyncio.create_task(pipe.submit(RequestContext("blocked")))
        await spin()
        assert not blocked.done()
        await pipe.stop(drain=False)
        for handle in (running, queued, await blocked):
            with pytest.raises(PipelineClosed):
                await handle.result()
        assert log == [("run", "s"), ("cleanup", "s", "PipelineClosed")]
        assert pipe.in_flight() == 0
        with pytest.raises(PipelineClosed):
            await pipe.submit(RequestContext("late"))
        with pytest.raises(PipelineClosed):
            await pipe.start()

    run_async(main())


def test_stop_with_drain_finishes_accepted_requests() -> None:
    gate = asyncio.Event()

    async def wait(ctx: RequestContext[Any]) -> None:
        await gate.wait()

    async def main() -> None:
        pipe = Pipeline([FunctionStage("s", wait)])
        await pipe.start()
        handles = [await pipe.submit(RequestContext(f"r{i}")) for i in range(3)]
        stopping = asyncio.create_task(pipe.stop(drain=True))
        await spin()
        assert not stopping.done()
        with pytest.raises(PipelineClosed):
            pipe.try_submit(RequestContext("late"))
        gate.set()
        await stopping
        for handle in handles:
            await handle.result()

    run_async(main())


def test_stop_drain_timeout_falls_back_to_failing() -> None:
    async def main() -> None:
        pipe = Pipeline([Tracked("s", [], block=asyncio.Event())])
        await pipe.start()
        handle = await pipe.submit(RequestContext("r"))
        await pipe.stop(drain=True, timeout_s=0.02)
        with pytest.raises(PipelineClosed):
            await handle.result()

    run_async(main())


def test_submit_validation() -> None:
    async def main() -> None:
        pipe = Pipeline([Tracked("s", [])])
        with pytest.raises(PipelineClosed, match="not running"):
            await pipe.submit(RequestContext("r"))
        async with pipe:
            ctx = RequestContext("r")
            await (await pipe.submit(ctx)).result()
            with pytest.raises(ValueError, match="already submitted"):
                await pipe.submit(ctx)
            with pytest.raises(TypeError, match="RequestContext"):
                await pipe.submit("r")  # type: ignore[arg-type]

    run_async(main())
