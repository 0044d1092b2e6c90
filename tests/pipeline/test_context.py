"""RequestContext on its own (no pipeline): ids, deadlines, cancel, spans, emit, children."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from kvflow.pipeline import (
    DeadlineExceeded,
    OutputChannel,
    RequestCancelled,
    RequestContext,
    TraceStatus,
)

from .conftest import FakeClock, run_async


def test_ids_state_and_validation() -> None:
    ctx: RequestContext[Any] = RequestContext()
    assert len(ctx.request_id) == 32 and isinstance(ctx.state, SimpleNamespace)
    typed = RequestContext("r", state={"k": 1})
    assert typed.state == {"k": 1}
    with pytest.raises(ValueError, match="request_id"):
        RequestContext("")
    with pytest.raises(ValueError, match="not both"):
        RequestContext("r", deadline=1.0, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        RequestContext("r", timeout_s=0)


def test_deadline_with_injected_clock() -> None:
    clock = FakeClock(100.0)
    ctx = RequestContext("r", clock=clock, timeout_s=2.5)
    assert ctx.created == 100.0 and ctx.deadline == 102.5
    assert ctx.remaining_s() == 2.5 and not ctx.expired
    ctx.checkpoint()
    clock.advance(2.5)
    assert ctx.expired
    with ctx.stage_span("prefill"), pytest.raises(DeadlineExceeded) as info:
        ctx.checkpoint()
    assert info.value.stage == "prefill" and info.value.request_id == "r"
    assert RequestContext("x", clock=clock).remaining_s() is None


def test_cancel_is_idempotent_notifies_listeners_and_checkpoint_raises() -> None:
    ctx = RequestContext("r")
    heard: list[str] = []
    ctx.add_cancel_listener(heard.append)
    assert ctx.cancel("stop") and not ctx.cancel("again")
    assert ctx.cancelled and ctx.cancel_reason == "stop" and heard == ["stop"]
    late: list[str] = []
    ctx.add_cancel_listener(late.append)
    assert late == ["stop"]
    with pytest.raises(RequestCancelled, match="stop"):
        ctx.checkpoint()


def test_spans_nest_and_record_errors() -> None:
    clock = FakeClock(0.0)
    ctx = RequestContext("r", clock=clock)
    ctx.set_attr("tenant", "t1")  # outside any stage: a request attribute
    with ctx.stage_span("hash", n_blocks=4):
        clock.advance(1.0)
        with ctx.span("blake2b") as child:
            clock.advance(0.5)
            child.set_attr("bytes", 1024)
        with pytest.raises(ZeroDivisionError), ctx.span("bad"):
            raise ZeroDivisionError
        ctx.set_attrs(keys=4)
    assert ctx.current_stage() is None
    spans = ctx.spans()
    assert [(s.name, s.parent, s.stage) for s in spans] == [
        ("hash", None, "hash"),
        ("blake2b", 1, "hash"),
        ("bad", 1, "hash"),
    ]
    assert spans[0].duration_s == 1.5 and dict(spans[0].attrs) == {"n_blocks": 4, "keys": 4}
    assert spans[1].start_s == 1.0 and spans[1].duration_s == 0.5
    assert spans[2].attrs["error"] == "ZeroDivisionError"
    trace = ctx.to_trace(TraceStatus.OK, None)
    assert trace.attrs == {"tenant": "t1"} and trace.spans == spans
    with pytest.raises(ValueError, match="span name"), ctx.span(""):
        pass
    with pytest.raises(ValueError, match="attribute key"):
        ctx.set_attr("", 1)


def test_spans_from_threads_and_unfinished_spans() -> None:
    ctx = RequestContext("r")
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        barrier.wait()
        with ctx.span(f"io{i}") as span:
            span.set_attr("i", i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(s.name for s in ctx.spans()) == ["io0", "io1", "io2", "io3"]
    assert len({s.span_id for s in ctx.spans()}) == 4
    with ctx.span("left-open") as span:
        trace = ctx.to_trace(TraceStatus.ERROR, RuntimeError("x"))
        with pytest.raises(RuntimeError, match="closed"):
            span.set_attr("late", 1)
    assert len(ctx.spans()) == 5  # closing it afterwards records nothing twice
    assert trace.error == "RuntimeError: x"
    assert trace.spans[-1].name == "left-open" and trace.spans[-1].attrs["unfinished"] is True


def test_children_spawn_join_and_span_lanes() -> None:
    async def main() -> None:
        ctx = RequestContext("r")

        async def child(value: int) -> int:
            with ctx.span("inner"):
                await asyncio.sleep(0)
            return value * 2

        with ctx.stage_span("prefill"):
            ctx.spawn("stream", child(21))
            with pytest.raises(ValueError, match="still running"):
                ctx.spawn("stream", child(1))
        assert await ctx.join("stream") == 42
        with pytest.raises(KeyError, match="nope"):
            await ctx.join("nope")
        spans = {s.name: s for s in ctx.spans()}
        assert spans["stream"].parent is None and spans["stream"].stage == "stream"
        assert spans["inner"].parent == spans["stream"].span_id
        assert spans["inner"].stage == "stream"

    run_async(main())


def test_output_channel_close_with_error_after_items_and_drop_after_close() -> None:
    async def main() -> None:
        channel = OutputChannel()
        channel.bind(asyncio.get_running_loop())
        assert channel.put(1) and channel.put(2)
        channel.close(ValueError("boom"))
        channel.close(None)  # ignored: first close wins
        assert not channel.put(3)
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for item in channel:
                got.append(item)
        assert got == [1, 2] and channel.put_count == 2 and channel.pending() == 0

    run_async(main())


def test_output_channel_wakes_consumer_from_thread() -> None:
    async def main() -> None:
        ctx = RequestContext("r")
        ctx.channel.bind(asyncio.get_running_loop())

        def producer() -> None:
            for i in range(100):
                ctx.emit(i)
            ctx.channel.close()

        consumer = asyncio.create_task(_collect(ctx.channel))
        await asyncio.sleep(0)
        thread = threading.Thread(target=producer)
        thread.start()
        assert await consumer == list(range(100))
        thread.join()

    run_async(main())


async def _collect(channel: OutputChannel) -> list[Any]:
    return [item async for item in channel]
