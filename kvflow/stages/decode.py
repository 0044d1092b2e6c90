"""decode: join the decode instance's continuous batch and stream tokens back.

The decode engine is given the prompt plus the first token (sampled by the prefill), with the
prompt's KV imported from the staging slots that ``stream`` filled: it computes the one new
token's KV and goes on decoding. The staging slots are returned as soon as the engine has
copied them into its own pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from kvflow.pipeline import RequestContext, Stage
from kvflow.stages.engine import Engine, RequestOutput
from kvflow.stages.errors import engine_error
from kvflow.stages.instances import DecodeInstance
from kvflow.stages.state import GenerateState
from kvflow.stages.worker import WorkItem


class DecodeStage(Stage):
    name = "decode"

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        await ctx.join("prefill")
        inst = state.decode
        assert inst is not None and state.prompt_ids is not None and state.first_token is not None
        state.output_ids = [state.first_token]
        state.token_times = [state.first_token_at or time.monotonic()]
        if state.finish_reason == "stop" or state.max_tokens == 1:
            state.finish_reason = state.finish_reason or "length"
            self._release_staging(state)
            state.finished_at = time.monotonic()
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()
        num_pages = -(-state.prompt_len // self._block_size)

        def on_admitted(engine: Engine) -> None:
            loop.call_soon_threadsafe(self._admitted, state)

        def sink(engine: Engine, out: RequestOutput) -> None:
            loop.call_soon_threadsafe(events.put_nowait, out)

        def on_error(exc: BaseException) -> None:
            loop.call_soon_threadsafe(events.put_nowait, exc)

        assert state.staging is not None
        engine_rid = f"{ctx.request_id}/decode"
        inst.worker.submit(
            WorkItem(
                request_id=engine_rid,
                token_ids=[*state.prompt_ids, state.first_token],
                sampling=dataclasses.replace(state.sampling, max_tokens=state.max_tokens - 1),
                sink=sink,
                on_error=on_error,
                prefix_pages=inst.staging.pages(state.staging, num_pages),
                num_prefix_tokens=state.prompt_len,
                verify_pages=False,  # copies of pages the prefill engine computed
                on_admitted=on_admitted,
            )
        )
        try:
            await self._consume(ctx, state, inst, events)
        except BaseException:
            inst.worker.abort(engine_rid)
            raise
        state.finished_at = time.monotonic()
        ctx.set_attrs(output_tokens=len(state.output_ids), finish_reason=state.finish_reason)

    async def _consume(
        self,
        ctx: RequestContext[Any],
        state: GenerateState,
        inst: DecodeInstance,
        events: asyncio.Queue[Any],
    ) -> None:
        while True:
            out = await events.get()
            if isinstance(out, BaseException):
                raise engine_error(out, inst.instance_id)
            if out.new_token_ids:
                now = time.monotonic()
                state.output_ids.extend(out.new_token_ids)
                state.token_times.extend(now for _ in out.new_token_ids)
                inst.state.grow_decode(ctx.request_id, len(out.new_token_ids))
                ctx.emit(("tokens", list(out.new_token_ids)))
            if out.finished:
                state.finish_reason = out.finish_reason
                return

    @staticmethod
    def _admitted(state: GenerateState) -> None:
        state.decode_admitted = True
        DecodeStage._release_staging(state)

    @staticmethod
    def _release_staging(state: GenerateState) -> None:
        if state.staging is not None and state.decode is not None:
            state.decode.staging.release(state.staging)
            state.staging = None

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        self._release_staging(ctx.state)
