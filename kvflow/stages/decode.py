"""decode: join the decode instance's continuous batch and stream tokens back.

The decode engine is given the prompt plus the first token (sampled by the prefill), with the
prompt's KV imported from the staging slots that ``stream`` filled: it computes the one new
token's KV and goes on decoding. The staging slots are returned as soon as the engine has
copied them into its own pool. Colocated (``state.colocated``, one engine for both), the
decode request adopts the prefill request's pages in place instead: no staging, no copy; and
it is not submitted from here but continues the prefill on the engine thread
(``DecodeStage.continuation``, given to the prefill's work item): the worker admits it as the
prefill's last output is handed on, so the engine's very next step decodes it, while the
event loop is still taking the first token. This stage then only consumes its outputs.
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
from kvflow.stages.runtime.worker import Continuation, WorkItem
from kvflow.stages.state import GenerateState

logger = logging.getLogger(__name__)


def decode_follows(max_tokens: int, first_finish: str | None) -> bool:
    """Whether a decode follows the prefill's first token (``first_finish``: the prefill
    request's finish reason): not when that token stopped the request, nor for max_tokens 1.
    The one place that decides it, on the engine thread (the colocated continuation) as in
    the stage."""
    return first_finish != "stop" and max_tokens > 1


def _admitted(state: GenerateState) -> None:
    """The decode engine admitted the request (on the loop)."""
    state.decode_admitted = True
    state.release_staging()  # the engine has copied the staged pages


class _DecodeRun:
    """One request's decode request on its engine: the work item, and the queue through
    which the engine thread hands its outputs to the event loop. Built on the event loop."""

    def __init__(self, request_id: str, state: GenerateState, block_size: int) -> None:
        self.engine_rid = f"{request_id}/decode"
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self._state = state
        self._block_size = block_size
        self._loop = asyncio.get_running_loop()

    def item(self, first_token: int) -> WorkItem:
        state, inst, loop = self._state, self._state.decode, self._loop
        assert inst is not None and state.prompt_ids is not None
        first_new_block = state.prompt_len // self._block_size

        def on_admitted(engine: Engine) -> None:
            loop.call_soon_threadsafe(_admitted, state)

        def sink(engine: Engine, out: RequestOutput) -> None:
            generated: tuple[list[int], dict[int, Any]] | None = None
            if out.finished and out.finish_reason != "abort":
                # Full blocks past the prompt's: their KV is only here. Views of retained pages.
                end = out.num_computed_tokens // self._block_size
                pages = engine.export_pages(out.request_id, range(first_new_block, end))
                generated = (engine.token_ids(out.request_id), pages)
            loop.call_soon_threadsafe(self.events.put_nowait, (out, generated))

        if state.colocated:  # the prefill's pages, in place (its request is forgotten)
            prefix_pages, adopt_from = [], state.engine_request_id
        else:
            assert state.staging is not None
            num_pages = -(-state.prompt_len // self._block_size)
            prefix_pages, adopt_from = inst.staging.pages(state.staging, num_pages), None
        return WorkItem(
            request_id=self.engine_rid,
            token_ids=[*state.prompt_ids, first_token],
            # The prompt's logprobs were the prefill's to compute.
            sampling=dataclasses.replace(
                state.sampling, max_tokens=state.max_tokens - 1, prompt_logprobs=None
            ),
            sink=sink,
            on_error=self.error,
            prefix_pages=prefix_pages,
            num_prefix_tokens=state.prompt_len,
            retain_pages=True,  # released once its new blocks are stored
            verify_pages=False,  # copies of pages the prefill engine computed
            block_keys=state.block_keys,  # the prompt's: pages shared by key
            num_output_tokens=1,  # the first token: a grammar continues after it
            adopt_from=adopt_from,
            on_admitted=on_admitted,
        )

    def error(self, exc: BaseException) -> None:
        """The decode request failed (any thread): the stage raises it."""
        self._loop.call_soon_threadsafe(self.events.put_nowait, exc)

    def after_prefill(self, engine: Engine, out: RequestOutput) -> WorkItem | None:
        """The continuation of the prefill's work item (engine thread): its last output
        ``out`` carries the first token; the decode's item, if one follows."""
        if not decode_follows(self._state.max_tokens, out.finish_reason):
            return None
        try:
            return self.item(out.new_token_ids[0])
        except Exception as exc:  # a WorkItem.then must not raise: the stage sees it
            self.error(exc)
            return None


class DecodeStage(Stage):
    name = "decode"

    def __init__(self, block_size: int, wait_for_prefill: bool) -> None:
        """``wait_for_prefill``: the prefill runs in this pipeline as a background stage (the
        embedded server) and its end is awaited before the request's pages are released (its
        kvdb stores read them); False on a decode node, where the prefill ran elsewhere and
        the call arrives after it."""
        self._block_size = block_size
        self._wait_for_prefill = wait_for_prefill

    def continuation(self, ctx: RequestContext[Any]) -> Continuation | None:
        """For the prefill's work item (``PrefillStage``, on the event loop): colocated, the
        decode's continuation (``WorkItem.then``), whose outputs this stage consumes later;
        None otherwise (the stage submits the decode itself)."""
        state: GenerateState = ctx.state
        if not state.colocated:
            return None
        run = _DecodeRun(ctx.request_id, state, self._block_size)
        state.decode_request_id = run.engine_rid  # from now on cleanup drops it
        state.decode_events = run.events
        return run.after_prefill

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        inst = state.decode
        assert inst is not None and state.prompt_ids is not None and state.first_token is not None
        state.output_ids = [state.first_token]
        state.token_times = [state.first_token_at or time.monotonic()]
        if not decode_follows(state.max_tokens, state.finish_reason):
            state.finish_reason = state.finish_reason or "length"
            state.release_staging()
            state.finished_at = time.monotonic()
            await self._prefill_over(ctx)
            if state.colocated:  # nobody adopts the prefill's pages
                await asyncio.wrap_future(inst.worker.drop(state.engine_request_id))
            return
        events = state.decode_events
        if events is None:  # not continued on the engine thread: submitted now
            run = _DecodeRun(ctx.request_id, state, self._block_size)
            inst.worker.submit(run.item(state.first_token))
            state.decode_request_id = run.engine_rid
            events = run.events
        ctx.set_attrs(continued=state.decode_events is not None)
        generated = await self._consume(ctx, state, inst, events)
        state.finished_at = time.monotonic()
        await self._prefill_over(ctx)  # colocated, its stores read the pages this one holds
        if generated is not None and generated[1]:
            with ctx.span("decode.store", blocks=len(generated[1])):
                state.stored_decode_blocks = await asyncio.to_thread(
                    self._store_generated, state, inst, *generated
                )
        await asyncio.wrap_future(inst.worker.drop(state.decode_request_id))
        state.decode_request_id = ""
        ctx.set_attrs(output_tokens=len(state.output_ids), finish_reason=state.finish_reason)

    async def _prefill_over(self, ctx: RequestContext[Any]) -> None:
        """Wait for the prefill stage's end (its kvdb stores of the prompt's blocks) before
        the pages they read are released."""
        if self._wait_for_prefill:
            ctx.state.stores_due.set()  # the request ends once they are done: no more waiting
            await ctx.join("prefill")

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

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        state: GenerateState = ctx.state
        state.stores_due.set()
        state.release_staging()
        state.booking.release_decode()
        if state.decode is not None and state.decode_request_id:
            await asyncio.wrap_future(state.decode.worker.drop(state.decode_request_id))
