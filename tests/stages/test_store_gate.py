"""StoreGate (``runtime/store_gate.py``): a colocated engine's prompt stores wait while another
prompt admitted to it has not had its first token, at most ``max_wait_s``."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.stages.runtime.store_gate import StoreGate


def test_open_until_a_prompt_enters_and_again_once_the_last_leaves() -> None:
    async def go() -> None:
        gate = StoreGate(max_wait_s=60.0)
        assert await gate.wait() == 0.0  # nobody prefilling: at once
        gate.enter()
        gate.enter()
        waiter = asyncio.ensure_future(gate.wait())
        await asyncio.sleep(0)
        gate.leave()
        await asyncio.sleep(0)
        assert not waiter.done() and gate.prefilling == 1  # one prompt still prefilling
        gate.leave()
        assert await asyncio.wait_for(waiter, 60) >= 0.0
        assert gate.prefilling == 0
        assert await gate.wait() == 0.0

    asyncio.run(go())


def test_waits_at_most_max_wait() -> None:
    async def go() -> None:
        gate = StoreGate(max_wait_s=0.05)
        gate.enter()  # never leaves
        waited = await asyncio.wait_for(gate.wait(), 60)
        assert waited >= 0.05

    asyncio.run(go())


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="max_wait_s must be >= 0"):
        StoreGate(max_wait_s=-1)
    with pytest.raises(RuntimeError, match="leave without a matching enter"):
        StoreGate().leave()


def test_a_due_request_stops_waiting() -> None:
    async def go() -> None:
        gate = StoreGate(max_wait_s=60.0)
        gate.enter()  # another prompt, still prefilling
        due = asyncio.Event()
        waiter = asyncio.ensure_future(gate.wait(due))
        await asyncio.sleep(0)
        assert not waiter.done()
        due.set()  # the waiting stores' request is ending
        assert await asyncio.wait_for(waiter, 60) >= 0.0
        assert gate.prefilling == 1
        assert await gate.wait(due) == 0.0  # already due: at once

    asyncio.run(go())
