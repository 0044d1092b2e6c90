"""When the prefill stage stores a prompt's completed blocks in its kvdb shard
(``prefill.py``, ``HeldStores``): colocated, not one store is submitted before the first
token is emitted (a store beside the prompt's later chunks takes the shared engine's CPU);
disaggregated, each chunk's blocks are submitted as they complete. Both store every full
block in the end. Submissions are recorded by the event loop's executor, in the loop's own
order, so the checks do not depend on thread timing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvflow.stages.prefill import HeldStores, PrefillStage
from kvflow.stages.runtime.instances import DecodeInstance
from tests.stages.conftest import BLOCK, Rig, context

PROMPT = [(i * 37) % 300 + 10 for i in range(5 * BLOCK + 5)]  # 3 chunks of <= 32


class RecordingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that counts the calls submitted to it (on the submitting thread)."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submitted = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def _prefill(rig: Rig, rid: str, colocated: bool) -> tuple[int, list[int]]:
    """Runs the prefill stage alone; returns the store calls submitted before the first
    token was emitted and which of the prompt's full blocks the shard holds after."""
    state = rig.state(PROMPT, max_tokens=4)
    prefill = rig.prefill["prefill-0"]
    state.prefill = prefill
    decode = rig.decode["decode-0"]
    if colocated:  # the decode instance on the prefill's engine, as a colocated server has
        decode = DecodeInstance(
            "decode-c", prefill.worker, decode.state, decode.staging, decode.store
        )
    state.decode = decode
    assert state.colocated is colocated
    ctx = context(rid, state)
    executor = RecordingExecutor()
    before_token: list[int] = []
    emit = ctx.emit

    def recording_emit(item: Any) -> bool:
        if item[0] == "tokens" and not before_token:
            before_token.append(executor.submitted)
        return emit(item)

    ctx.emit = recording_emit  # type: ignore[method-assign]
    stage = PrefillStage(BLOCK)

    async def go() -> None:
        asyncio.get_running_loop().set_default_executor(executor)
        try:
            await stage.run(ctx)
        finally:
            await stage.cleanup(ctx, None)

    _run(executor, go)
    assert state.first_token is not None and len(before_token) == 1
    return before_token[0], _stored(rig, state)


def _run(executor: concurrent.futures.Executor, go: Callable[[], Any]) -> None:
    try:
        asyncio.run(go())
    finally:
        executor.shutdown(wait=True)


def _stored(rig: Rig, state: Any) -> list[int]:
    """Which of the prompt's blocks the prefill instance's shard holds."""
    shard = rig.prefill["prefill-0"].store.shard
    return [b for b, key in enumerate(state.block_keys) if shard.exists(key)]


@pytest.mark.parametrize("colocated", [True, False])
def test_stores_wait_for_the_first_token_only_colocated(rig: Rig, colocated: bool) -> None:
    assert rig.config.prefill_chunk == 32  # so the prompt takes 3 steps
    submitted, held = _prefill(rig, f"r-{colocated}", colocated)
    if colocated:
        assert submitted == 0
    else:
        assert submitted >= 1  # the first chunks' blocks, before the last chunk's token
    assert held == list(range(len(PROMPT) // BLOCK))  # every full block stored in the end
    assert rig.prefill["prefill-0"].worker.call(lambda e: e.num_free_pages).result(10) == 128


def test_held_stores_release_one_batch_at_the_first_token() -> None:
    held = HeldStores(hold=True)
    held.add(([b"a"], ["va"], [None]))  # type: ignore[list-item]
    assert held.release(first_token=False) is None
    held.add(None)
    held.add(([b"b"], ["vb"], [b"a"]))  # type: ignore[list-item]
    assert held.release(first_token=True) == ([b"a", b"b"], ["va", "vb"], [None, b"a"])
    assert held.release(first_token=True) is None
    passing = HeldStores(hold=False)
    passing.add(([b"a"], ["va"], [None]))  # type: ignore[list-item]
    assert passing.release(first_token=False) == ([b"a"], ["va"], [None])


@pytest.mark.parametrize("opens", ["the other prompt leaves", "the request ends"])
def test_colocated_stores_wait_while_another_prompt_is_prefilled(rig: Rig, opens: str) -> None:
    """Another prompt admitted to the engine holds the gate: the prompt's stores are not
    submitted after its first token until that one leaves, or until the request's end needs
    them (``stores_due``: its decode is over); then every block is stored."""
    state = rig.state(PROMPT, max_tokens=4)
    prefill = rig.prefill["prefill-0"]
    decode = rig.decode["decode-0"]
    state.prefill = prefill
    state.decode = DecodeInstance(
        "decode-c", prefill.worker, decode.state, decode.staging, decode.store
    )
    assert state.colocated
    gate = prefill.store_gate
    ctx = context(f"r-gated-{len(opens)}", state)
    executor = RecordingExecutor()
    stage = PrefillStage(BLOCK)

    async def go() -> None:
        asyncio.get_running_loop().set_default_executor(executor)
        first = asyncio.Event()
        emit = ctx.emit

        def recording_emit(item: Any) -> bool:
            if item[0] == "tokens":
                first.set()
            return emit(item)

        ctx.emit = recording_emit  # type: ignore[method-assign]
        gate.enter()  # the other prompt
        run = asyncio.ensure_future(stage.run(ctx))
        try:
            await asyncio.wait_for(first.wait(), 120)
            done, _ = await asyncio.wait({run}, timeout=0.5)
            assert not done and executor.submitted == 0  # its stores wait for the gate
            assert gate.prefilling == 1  # the prompt itself left at its first token
            if opens == "the request ends":
                state.stores_due.set()
                await asyncio.wait_for(run, 120)
                assert gate.prefilling == 1  # the other prompt still holds it
            gate.leave()
            await asyncio.wait_for(run, 120)
            assert executor.submitted >= 1
        finally:
            await stage.cleanup(ctx, None)

    _run(executor, go)
    assert gate.prefilling == 0
    assert _stored(rig, state) == list(range(len(PROMPT) // BLOCK))
