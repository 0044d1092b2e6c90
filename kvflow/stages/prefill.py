"""chunked prefill: compute the uncached suffix on the prefill engine, chunk by chunk.

Runs as a *background* stage: the pipeline moves the request on to ``stream`` at once, and the
two overlap. Each step's newly completed blocks are (1) written to the instance's kvdb shard
and (2) handed to ``stream`` through ``state.block_queue`` as page views of the engine's pool.
The request's pages are retained after the prefill finishes, until ``stream`` has moved them
(it releases them), or until cleanup.

Queue items: ``("pages", {block_index: page_view})`` ... then ``("done", None)``: once every
block is stored; colocated, as soon as the first token is emitted (the stores may still read
the pages: the decode, which holds them then, joins this stage before releasing them).

Colocated, the prefill's work item carries the decode's continuation (``continuation``,
``DecodeStage.continuation``): the engine thread admits the decode as the prefill finishes.

When the stores start (``HeldStores``): not colocated, each step's completed blocks are
stored at once, so "done" (after the stores) follows the last chunk closely and the decode
side is not kept waiting. Colocated, they are held until the first token is on its way: on
the shared engine's cores a store beside the prompt's later chunks took CPU from the forward
(~0.3-0.5 s of a cold 2,000-token prompt's time to the first token, docs/performance.md),
and nothing waits for them before then (the decode joins this stage only before it releases
the pages; a concurrent request shares the pages by key in the engine). Then they wait
further, while another prompt admitted to the same engine has not had its first token
(``runtime/store_gate.py``): a first write into the DRAM tier costs the cores those prompts
compute on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from kvflow.kvdb import BlockKey, EmbeddedClient
from kvflow.pipeline import RequestContext, Stage
from kvflow.stages.engine import Engine, RequestOutput
from kvflow.stages.errors import engine_error
from kvflow.stages.reuse_load import release_load_buffers, unpin_prefix
from kvflow.stages.runtime.store_gate import StoreGate
from kvflow.stages.runtime.worker import Continuation, WorkItem
from kvflow.stages.state import GenerateState

logger = logging.getLogger(__name__)

Pages = dict[int, torch.Tensor]
Blocks = tuple[list[BlockKey], list[torch.Tensor], list[bytes | None]]
"""Blocks to store: their keys, page views and parent keys."""


class HeldStores:
    """Which of a prefill's completed blocks to store now (module doc): with ``hold``, none
    until the first token (or the end); without, each step's as they come."""

    def __init__(self, hold: bool) -> None:
        self._hold = hold
        self._keys: list[BlockKey] = []
        self._views: list[torch.Tensor] = []
        self._parents: list[bytes | None] = []

    def add(self, blocks: Blocks | None) -> None:
        """A step's newly completed blocks (None: none)."""
        if blocks is not None:
            self._keys.extend(blocks[0])
            self._views.extend(blocks[1])
            self._parents.extend(blocks[2])

    def release(self, first_token: bool) -> Blocks | None:
        """The blocks to store now, as one batch (None: none), after a step's output was
        handed on; ``first_token``: that output carried the first token or ended the
        prefill."""
        if not self._keys or (self._hold and not first_token):
            return None
        blocks = (self._keys, self._views, self._parents)
        self._keys, self._views, self._parents = [], [], []
        return blocks


class PrefillStage(Stage):
    name = "prefill"
    background = True

    def __init__(
        self,
        block_size: int,
        continuation: Callable[[RequestContext[Any]], Continuation | None] | None = None,
    ) -> None:
        """``continuation(ctx)``: what continues the request on the engine thread once its
        prefill finishes (``WorkItem.then``), or None (the embedded server's decode stage)."""
        self._block_size = block_size
        self._continuation = continuation

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        inst = state.prefill
        assert inst is not None and state.prompt_ids is not None and state.namespace is not None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()
        bs = self._block_size
        prompt_len = state.prompt_len
        state.engine_request_id = f"{ctx.request_id}/prefill"

        def on_admitted(engine: Engine) -> None:
            # Imported prefix pages are never reported as completed: hand them on now (to
            # stream; kvdb already holds them). Colocated, stream only counts them: the
            # engine's own views, not copies to the host (on a GPU, export_pages copies).
            rid, imported = state.engine_request_id, range(state.num_cached_tokens // bs)
            if state.colocated:
                pages = {b: engine.export_page(rid, b) for b in imported}
            else:
                pages = engine.export_pages(rid, imported)
            loop.call_soon_threadsafe(events.put_nowait, ("admitted", pages))

        def sink(engine: Engine, out: RequestOutput) -> None:
            blocks = list(out.completed_blocks)
            if out.finished and out.finish_reason != "abort" and prompt_len % bs:
                blocks.append((prompt_len - 1) // bs)  # the partial last block
            pages = engine.export_pages(out.request_id, blocks)
            loop.call_soon_threadsafe(events.put_nowait, (out, pages))

        def on_error(exc: BaseException) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("error", exc))

        item = WorkItem(
            request_id=state.engine_request_id,
            token_ids=state.prompt_ids,
            sampling=dataclasses.replace(state.sampling, max_tokens=1),
            sink=sink,
            on_error=on_error,
            prefix_pages=state.prefix_pages,
            num_prefix_tokens=state.num_cached_tokens,
            retain_pages=True,
            verify_pages=False,  # kvdb verified each block's checksum
            block_keys=state.block_keys,  # the namespace's chained keys: pages shared by key
            on_admitted=on_admitted,
            then=None if self._continuation is None else self._continuation(ctx),
        )
        state.booking.start_prefill(time.monotonic())
        inst.worker.submit(item)
        client = inst.client(state.namespace)
        stores: list[asyncio.Future[int]] = []
        # "done" lets stream release the pages (after the stores that read them); colocated,
        # the decode holds them and joins this stage first: its tokens need not wait
        stores_first = not state.colocated
        held = HeldStores(hold=state.colocated)
        gate = inst.store_gate if state.colocated else None
        try:
            await self._consume(ctx, state, events, client, stores, held, gate)
            if not stores_first:
                state.block_queue.put_nowait(("done", None))
        except BaseException:
            state.stores_due.set()  # failed or cancelled: the held stores go now
            raise
        finally:
            # Blocks already handed to the shard are waited for even on failure: their page
            # views must not outlive the request's pages.
            if stores:
                done = await asyncio.gather(*stores, return_exceptions=True)
                state.stored_blocks = sum(n for n in done if isinstance(n, int))
        state.prefill_done = True
        state.booking.release_prefill()  # the prefill is over: off the queue
        ctx.set_attrs(
            computed_tokens=prompt_len - state.num_cached_tokens,
            stored_blocks=state.stored_blocks,
        )
        if stores_first:
            state.block_queue.put_nowait(("done", None))

    async def _consume(
        self,
        ctx: RequestContext[Any],
        state: GenerateState,
        events: asyncio.Queue[Any],
        client: EmbeddedClient,
        stores: list[asyncio.Future[int]],
        held: HeldStores,
        gate: StoreGate | None,
    ) -> None:
        """Hand on the engine's outputs until the prefill finishes. With ``gate``, the prompt
        counts as being prefilled there from its admission to its first token (or its end),
        and its stores wait for the gate."""
        assert state.prefill is not None
        loop = asyncio.get_running_loop()
        entered = False
        try:
            while True:
                kind, payload = await events.get()
                if kind == "error":
                    raise engine_error(payload, state.prefill.instance_id)
                if kind == "admitted":
                    state.prefill_admitted = True
                    state.prefix_pages = []  # copied into the engine's pool
                    release_load_buffers(state)
                    unpin_prefix(state)
                    if payload:
                        state.block_queue.put_nowait(("pages", payload))
                    if gate is not None:
                        gate.enter()
                        entered = True
                    continue
                out: RequestOutput = kind
                held.add(self._new_full_blocks(state, out.completed_blocks, payload))
                if payload:
                    state.block_queue.put_nowait(("pages", payload))
                if out.prompt_logprobs:
                    if not state.prompt_logprobs:
                        state.prompt_logprobs_start = out.prompt_logprobs_start
                    state.prompt_logprobs.extend(out.prompt_logprobs)
                if out.new_token_ids:
                    state.output_logprobs.extend(out.logprobs)
                    state.first_token = out.new_token_ids[0]
                    state.first_token_at = time.monotonic()
                    ctx.emit(("tokens", list(out.new_token_ids)))
                first_token = bool(out.new_token_ids) or out.finished
                if first_token and entered:
                    assert gate is not None
                    gate.leave()
                    entered = False
                to_store = held.release(first_token=first_token)
                if to_store is not None:  # after the token: a store must not delay it
                    stores.append(self._store(loop, gate, state, client, to_store))
                if out.finished:
                    state.finish_reason = out.finish_reason
                    return
        finally:
            if entered:
                assert gate is not None
                gate.leave()

    def _store(
        self,
        loop: asyncio.AbstractEventLoop,
        gate: StoreGate | None,
        state: GenerateState,
        client: EmbeddedClient,
        blocks: Blocks,
    ) -> asyncio.Future[int]:
        """Store ``blocks`` on an executor thread: submitted now, in step order; with
        ``gate``, once no other prompt awaits its first token or the request's end needs them
        (``state.stores_due``)."""
        if gate is None:
            return loop.run_in_executor(None, _store_blocks, client, *blocks)
        return asyncio.ensure_future(_gated(loop, gate, state.stores_due, client, blocks))

    def _new_full_blocks(
        self, state: GenerateState, completed: tuple[int, ...], pages: Pages
    ) -> Blocks | None:
        keys, views, parents = [], [], []
        for b in completed:
            if b < len(state.block_keys):
                keys.append(state.block_keys[b])
                views.append(pages[b])
                parents.append(state.block_keys[b - 1] if b > 0 else None)
        return (keys, views, parents) if keys else None

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        state: GenerateState = ctx.state
        state.booking.release_prefill()
        if state.prefill is not None and state.engine_request_id:
            await asyncio.wrap_future(state.prefill.worker.drop(state.engine_request_id))
            if state.decode_events is not None and state.decode_request_id:
                # colocated: its continuation, admitted unless the prefill was dropped first
                await asyncio.wrap_future(state.prefill.worker.drop(state.decode_request_id))


async def _gated(
    loop: asyncio.AbstractEventLoop,
    gate: StoreGate,
    due: asyncio.Event,
    client: EmbeddedClient,
    blocks: Blocks,
) -> int:
    """Store ``blocks`` on an executor thread, once ``gate`` is open or ``due`` is set (the
    request's end waits for them)."""
    waited = await gate.wait(due)
    if waited:
        logger.debug("stores of %d blocks waited %.3f s for others", len(blocks[0]), waited)
    return await loop.run_in_executor(None, _store_blocks, client, *blocks)


def _store_blocks(
    client: EmbeddedClient,
    keys: list[BlockKey],
    views: list[torch.Tensor],
    parents: list[bytes | None],
) -> int:
    """Write completed blocks to the shard (runs in an executor). Returns how many were stored;
    a full store is logged, not fatal: the request goes on, the blocks are just not cached."""
    try:
        stored = client.batch_put(keys, views, parents=parents)
    except Exception:
        logger.exception("storing %d blocks failed; they will be recomputed next time", len(keys))
        return 0
    return sum(1 for t in stored if t is not None)
