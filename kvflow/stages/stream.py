"""stream: move the request's KV pages to its decode instance while the prefill still runs.

Writes into ``state.stream_target``, which the route stage (embedded: the decode instance's
staging slots in this process) or the node's Prefill call (the decode node's reserved slots)
set before. Consumes ``state.block_queue`` (filled by the background prefill stage) and
writes each page from the prefill engine's pool (a registered transfer segment) into its
target slot through the transfer engine: a batch per prefill step, so transfers of early
chunks overlap the computation of later ones. When the prefill is done and every page
has moved, the prefill engine's pages are released.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from kvflow.pipeline import RequestContext, Stage
from kvflow.stages.runtime.instances import PrefillInstance, pool_segment_name
from kvflow.stages.state import GenerateState
from kvflow.transfer import (
    OpCode,
    TransferEngine,
    TransferError,
    TransferRequest,
)


class StreamFailed(RuntimeError):
    """A page could not be moved to the decode instance."""


class StreamStage(Stage):
    name = "stream"

    def __init__(
        self,
        transfer: TransferEngine,
        pools: dict[str, torch.Tensor],
        block_size: int,
        timeout_s: float = 30.0,
    ) -> None:
        self._transfer = transfer
        self._pools = pools  # prefill instance id -> its engine's page pool tensor
        self._block_size = block_size
        self._timeout_s = timeout_s

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        assert state.prefill is not None
        num_pages = -(-state.prompt_len // self._block_size)
        if state.stream_target is None:
            raise StreamFailed(f"req={ctx.request_id}: no stream target (route or Prefill sets it)")
        if len(state.stream_target.offsets) < num_pages:
            raise StreamFailed(
                f"req={ctx.request_id}: {num_pages} pages to stream, "
                f"{len(state.stream_target.offsets)} target slots"
            )
        while True:
            kind, pages = await state.block_queue.get()
            if kind == "done":
                break
            with ctx.span("stream.batch", pages=len(pages)) as span:
                moved = await asyncio.to_thread(self._move, state, pages)
                span.set_attrs(bytes=moved)
            state.streamed_blocks += len(pages)
            state.streamed_bytes += moved
        if state.streamed_blocks != num_pages:
            raise StreamFailed(
                f"req={ctx.request_id}: streamed {state.streamed_blocks} of {num_pages} pages"
            )
        # Every page is at the decode side: the prefill copy can go.
        await asyncio.wrap_future(state.prefill.worker.drop(state.engine_request_id))
        ctx.set_attrs(pages=state.streamed_blocks, bytes=state.streamed_bytes)

    def _move(self, state: GenerateState, pages: dict[int, torch.Tensor]) -> int:
        assert state.prefill is not None and state.stream_target is not None
        target = state.stream_target
        pool = self._pools[state.prefill.instance_id]
        base = pool.data_ptr()
        segment = pool_segment_name(state.prefill.instance_id)
        requests = [
            TransferRequest(
                opcode=OpCode.WRITE,
                local_segment=segment,
                local_offset=view.data_ptr() - base,
                target=target.segment,
                remote_offset=target.offsets[block],
                length=target.page_nbytes,
            )
            for block, view in sorted(pages.items())
        ]
        try:
            statuses = self._transfer.transfer(requests, timeout=self._timeout_s)
        except TransferError as exc:
            raise StreamFailed(f"moving {len(requests)} pages failed: {exc}") from exc
        failed = [s for s in statuses if not s.ok]
        if failed:
            raise StreamFailed(
                f"{len(failed)} of {len(requests)} page transfers failed: {failed[0]}"
            )
        return sum(r.length for r in requests)

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        ctx.state.release_staging()


def prefill_pool(inst: PrefillInstance) -> torch.Tensor:
    """The prefill engine's page pool tensor (registered as a transfer segment)."""
    return inst.worker.engine.pool_tensor
