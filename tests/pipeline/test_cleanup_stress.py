"""Seeded mix of successes, failures, cancels and deadlines: every entered stage is cleaned
up exactly once per request, in reverse order, and nothing is left running."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any

from kvflow.pipeline import (
    FunctionStage,
    Pipeline,
    PipelineConfig,
    RequestContext,
    Stage,
)

from .conftest import run_async


class Resource(Stage):
    """Takes a "page" per request in run and gives it back in cleanup."""

    def __init__(self, name: str, held: dict[str, set[str]], log: dict[str, list[str]]) -> None:
        self.name = name
        self.held = held
        self.log = log

    async def run(self, ctx: RequestContext[Any]) -> None:
        self.held[self.name].add(ctx.request_id)
        self.log[ctx.request_id].append(f"run {self.name}")
        plan = ctx.state.plan.get(self.name)
        await asyncio.sleep(ctx.state.rng.random() * 0.002)
        if plan == "raise":
            raise RuntimeError(f"{self.name} broke")
        if plan == "hang":
            await asyncio.Event().wait()

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        self.log[ctx.request_id].append(f"cleanup {self.name}")
        self.held[self.name].discard(ctx.request_id)


def test_random_failures_always_release_everything() -> None:
    rng = random.Random(1234)
    names = ["tokenize", "hash", "route", "load", "prefill", "decode"]
    held: dict[str, set[str]] = defaultdict(set)
    log: dict[str, list[str]] = defaultdict(list)

    async def stream(ctx: RequestContext[Any]) -> None:
        log[ctx.request_id].append("run stream")
        await asyncio.sleep(0.001)

    async def stream_cleanup(ctx: RequestContext[Any], error: BaseException | None) -> None:
        log[ctx.request_id].append("cleanup stream")

    stages: list[Stage] = [Resource(n, held, log) for n in names[:4]]
    stages.append(FunctionStage("stream", stream, cleanup=stream_cleanup, background=True))
    stages += [Resource(n, held, log) for n in names[4:]]

    async def main() -> dict[str, str]:
        config = PipelineConfig(queue_size=4, default_concurrency=3)
        outcomes: dict[str, str] = {}
        async with Pipeline(stages, config) as pipe:
            handles = []
            for i in range(120):
                roll = rng.random()
                ctx: RequestContext[Any] = RequestContext(
                    f"r{i}", timeout_s=0.05 if roll < 0.15 else None
                )
                ctx.state.rng = random.Random(i)
                ctx.state.plan = {}
                if roll < 0.15:
                    ctx.state.plan[rng.choice(names)] = "hang"  # deadline fires
                elif roll < 0.35:
                    ctx.state.plan[rng.choice(names)] = "raise"
                handle = await pipe.submit(ctx)
                if 0.35 <= roll < 0.5:
                    asyncio.get_running_loop().call_later(rng.random() * 0.005, handle.cancel)
                handles.append(handle)
            for handle in handles:
                try:
                    await handle.result()
                    outcomes[handle.request_id] = "ok"
                except Exception as exc:
                    outcomes[handle.request_id] = type(exc).__name__
            assert pipe.in_flight() == 0
        return outcomes

    outcomes = run_async(main(), timeout_s=30.0)
    assert set(outcomes.values()) >= {"ok", "StageError", "DeadlineExceeded", "RequestCancelled"}
    assert all(not ids for ids in held.values())
    for rid, entries in log.items():
        ran = [e.split()[1] for e in entries if e.startswith("run ")]
        cleaned = [e.split()[1] for e in entries if e.startswith("cleanup ")]
        assert cleaned == list(reversed(ran)), (rid, entries)
        first_cleanup = next(i for i, e in enumerate(entries) if e.startswith("cleanup"))
        assert all(e.startswith("cleanup") for e in entries[first_cleanup:]), (rid, entries)
