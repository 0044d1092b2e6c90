"""Helpers for the pipeline tests: run a coroutine with a hard time limit, a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
    """Run ``coro`` on a fresh event loop; fail (not hang) after ``timeout_s``."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


class FakeClock:
    """A hand-driven monotonic clock."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def spin(turns: int = 20) -> None:
    """Yield to the loop ``turns`` times, letting every ready task progress."""
    for _ in range(turns):
        await asyncio.sleep(0)
