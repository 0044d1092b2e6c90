"""decode: join the decode instance's continuous batch and stream tokens back.

The decode engine is given the prompt plus the first token (sampled by the prefill), with the
prompt's KV imported from the staging slots that ``stream`` filled: it computes the one new
token's KV and goes on decoding. The staging slots are returned as soon as the engine has
copied them into its own pool. Colocated (``state.colocated``, one engine for both), the
decode request adopts the prefill request's pages in place instead: no staging, no copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from kvflow.kvdb import block_keys
from kvflow.pipeline import RequestContext, Stage
from kvflow.stages.engine import Engine, RequestOutput
from kvflow.stages.errors import engine_error
from kvflow.stages.runtime.instances import DecodeInstance
from kvflow.stages.runtime.worker import WorkItem
from kvflow.stages.state import GenerateState

logger = logging.getLogger(__name__)


class DecodeStage(Stage):
    name = "decode"

    def __init__(self, block_size: int, wait_for_prefill: bool) -> None:
        """``wait_for_prefill``: the prefill runs in this pipeline as a background stage (the
        embedded server) and its end is awaited; False on a decode node, where the prefill
        ran elsewhere and the call arrives after it."""
        self._block_size = block_size
        self._wait_for_prefill = wait_for_prefill

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        if self._wait_for_prefill:
            await ctx.join("prefill")
        inst = state.decode
        assert inst is not None and state.prompt_ids is not None and state.first_token is not None
        state.output_ids = [state.first_token]
        state.token_times = [state.first_token_at or time.monotonic()]
        if state.finish_reason == "stop" or state.max_tokens == 1:
            state.finish_reason = state.finish_reason or "length"
            state.release_staging()
            state.finished_at = time.monotonic()
            if state.colocated:  # nobody adopts the prefill's pages
                await asyncio.wrap_future(inst.worker.drop(state.engine_request_id))
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()
        num_pages = -(-state.prompt_len // self._block_size)

        def on_admitted(engine: Engine) -> None:
            loop.call_soon_threadsafe(self._admitted, state)

        first_new_block = state.prompt_len // self._block_size

        def sink(engine: Engine, out: RequestOutput) -> None:
            generated: tuple[list[int], dict[int, Any]] | None = None
            if out.finished and out.finish_reason != "abort":
                # Full blocks past the prompt's: their KV is only here. Views of retained pages.
                end = out.num_computed_tokens // self._block_size
                pages = {
                    b: engine.export_page(out.request_id, b) for b in range(first_new_block, end)
                }
                generated = (engine.token_ids(out.request_id), pages)
            loop.call_soon_threadsafe(events.put_nowait, (out, generated))

        def on_error(exc: BaseException) -> None:
            loop.call_soon_threadsafe(events.put_nowait, exc)

        engine_rid = f"{ctx.request_id}/decode"
        if state.colocated:  # the prefill's pages, in place (its request is forgotten)
            prefix_pages, adopt_from = [], state.engine_request_id
        else:
            assert state.staging is not None
            prefix_pages, adopt_from = inst.staging.pages(state.staging, num_pages), None
        inst.worker.submit(
            WorkItem(
                request_id=engine_rid,
                token_ids=[*state.prompt_ids, state.first_token],
                # The prompt's logprobs were the prefill's to compute.
                sampling=dataclasses.replace(
                    state.sampling, max_tokens=state.max_tokens - 1, prompt_logprobs=None
                ),
                sink=sink,
                on_error=on_error,
                prefix_pages=prefix_pages,
                num_prefix_tokens=state.prompt_len,
                retain_pages=True,  # released once its new blocks are stored
                verify_pages=False,  # copies of pages the prefill engine computed
                block_keys=state.block_keys,  # the prompt's: pages shared by key
                num_output_tokens=1,  # the first token: a grammar continues after it
                adopt_from=adopt_from,
                on_admitted=on_admitted,
            )
        )
        state.decode_request_id = engine_rid
        generated = await self._consume(ctx, state, inst, events)
        state.finished_at = time.monotonic()
        if generated is not None and generated[1]:
            with ctx.span("decode.store", blocks=len(generated[1])):
                state.stored_decode_blocks = await asyncio.to_thread(
                    self._store_generated, state, inst, *generated
                )
        await asyncio.wrap_future(inst.worker.drop(engine_rid))
        state.decode_request_id = ""
        ctx.set_attrs(output_tokens=len(state.output_ids), finish_reason=state.finish_reason)

    async def _consume(
        self,
        ctx: RequestContext[Any],
        state: GenerateState,
        inst: DecodeInstance,
        events: asyncio.Queue[Any],
    ) -> tuple[list[int], dict[int, Any]] | None:
        while True:
            item = await events.get()
            if isinstance(item, BaseException):
                raise engine_error(item, inst.instance_id)
            out, generated = item
            if out.new_token_ids:
                now = time.monotonic()
                state.output_ids.extend(out.new_token_ids)
                state.token_times.extend(now for _ in out.new_token_ids)
                state.booking.grow_decode(len(out.new_token_ids))
                state.output_logprobs.extend(out.logprobs)
                ctx.emit(("tokens", list(out.new_token_ids)))
            if out.finished:
                state.finish_reason = out.finish_reason
                return generated

    def _store_generated(
        self,
        state: GenerateState,
        inst: DecodeInstance,
        tokens: list[int],
        pages: dict[int, Any],
    ) -> int:
        """Store the generated blocks in the decode shard, chained after the prompt's, so a
        follow-up turn (prompt + answer + more) reuses them. Failure is logged, not fatal."""
        assert state.namespace is not None
        keys = block_keys(state.namespace, tokens)
        order = sorted(b for b in pages if b < len(keys))
        try:
            stored = inst.client(state.namespace).batch_put(
                [keys[b] for b in order],
                [pages[b] for b in order],
                parents=[keys[b - 1] if b > 0 else None for b in order],
            )
        except Exception:
            logger.exception("storing %d decoded blocks failed; they are not cached", len(order))
            return 0
        return sum(1 for t in stored if t is not None)

    @staticmethod
    def _admitted(state: GenerateState) -> None:
        state.decode_admitted = True
        state.release_staging()  # the engine has copied the staged pages

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        state: GenerateState = ctx.state
        state.release_staging()
        state.booking.release_decode()
        if state.decode is not None and state.decode_request_id:
            await asyncio.wrap_future(state.decode.worker.drop(state.decode_request_id))
