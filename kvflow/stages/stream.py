"""stream: move the request's KV pages to its decode instance while the prefill still runs.

Colocated (``state.colocated``: the prefill and decode instances share one engine), nothing
moves: the decode adopts the prefill's pages in place, and this stage only waits for them.

Writes into ``state.stream_target``, which the route stage (embedded: the decode instance's
staging slots in this process) or the node's Prefill call (the decode node's reserved slots)
set before. Consumes ``state.block_queue`` (filled by the background prefill stage) and
writes each page from the prefill engine's host pool (a registered transfer segment: the
page pool itself on the CPU, its host mirror on a GPU, `Engine.host_pool`) into its target
slot through the transfer engine: a batch per prefill step, so transfers of early chunks
overlap the computation of later ones. When the prefill is done and every page
has moved, the prefill engine's pages are released.

A hung decode side (SIGSTOP, a stuck host) must not hold the prefill for long: each batch has
a deadline sized to its bytes (``PeerCallBudget.deadline_s``) and reports to the decode
side's circuit breaker (``PeerBreakers``, keyed by its transfer address, shared with the
process's block reads); a timeout opens it, and while it is open a stream into that side
fails at once. Either way the stage raises ``StreamTargetFailed`` naming the decode side.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from kvflow.kvdb import PeerBreakers
from kvflow.pipeline import RequestContext, Stage
from kvflow.stages.errors import StreamTargetFailed
from kvflow.stages.runtime.instances import pool_segment_name
from kvflow.stages.state import GenerateState
from kvflow.transfer import (
    OpCode,
    TransferEngine,
    TransferError,
    TransferRequest,
    TransferState,
    UnknownSegmentError,
)

logger = logging.getLogger(__name__)


class StreamFailed(RuntimeError):
    """A page could not be moved to the decode instance."""


class StreamStage(Stage):
    """``breakers``: the process's per-peer breakers and their budget (module doc); default:
    a new one."""

    name = "stream"

    def __init__(
        self,
        transfer: TransferEngine,
        pools: dict[str, torch.Tensor],
        block_size: int,
        breakers: PeerBreakers | None = None,
    ) -> None:
        self._transfer = transfer
        self._pools = pools  # prefill instance id -> its engine's host_pool (a segment)
        self._block_size = block_size
        self._breakers = breakers or PeerBreakers()

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        assert state.prefill is not None
        num_pages = -(-state.prompt_len // self._block_size)
        if state.colocated:
            await self._stay(ctx, state, num_pages)
            return
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

    async def _stay(self, ctx: RequestContext[Any], state: GenerateState, num_pages: int) -> None:
        """Colocated: the pages stay where the prefill wrote them (the decode adopts them in
        place, and keeps the prefill's engine request until then); count them as they come."""
        adopted = 0
        while True:
            kind, pages = await state.block_queue.get()
            if kind == "done":
                break
            adopted += len(pages)
        if adopted != num_pages:
            raise StreamFailed(f"req={ctx.request_id}: prefilled {adopted} of {num_pages} pages")
        ctx.set_attrs(pages=0, bytes=0, adopted_pages=adopted)

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
        nbytes = sum(r.length for r in requests)
        peer = target.segment.peer
        breaker = self._breakers.get(peer)
        if not breaker.allow():
            raise StreamTargetFailed(peer, "circuit open (it timed out or failed recently)")
        deadline = self._breakers.budget.deadline_s(nbytes)
        try:
            # the wait's own timeout only backs up the engine's deadline (its watchdog ticks)
            statuses = self._transfer.transfer(requests, deadline + 1.0, deadline_s=deadline)
        except TransferError as exc:
            breaker.failure()
            raise StreamTargetFailed(peer, f"moving {len(requests)} pages: {exc}") from exc
        except BaseException:
            breaker.failure()  # an allowed probe must report
            raise
        failed = [s for s in statuses if not s.ok]
        if failed:
            timed_out = any(s.state is not TransferState.FAILED for s in failed)
            if breaker.trip() if timed_out else breaker.failure():
                logger.warning("stream target %s failed; skipping it for a while", peer)
            raise StreamTargetFailed(
                peer,
                f"{len(failed)} of {len(requests)} page transfers failed "
                f"(deadline {deadline:.2f}s): {failed[0]}",
            )
        breaker.success()
        return nbytes

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        ctx.state.release_staging()


def open_stream_target(
    transfer: TransferEngine, breakers: PeerBreakers, peer: str, segment: str
) -> Any:
    """The decode side's staging segment as a transfer target (blocking: a describe round
    trip). StreamTargetFailed at once while the peer's breaker is open, or when it cannot be
    opened (then the breaker opens: a peer that does not describe a segment is down or
    hung; a missing segment counts as a failure)."""
    breaker = breakers.get(peer)
    if not breaker.allow():
        raise StreamTargetFailed(peer, "circuit open (it timed out or failed recently)")
    try:
        handle = transfer.open_segment(peer, segment)
    except TransferError as exc:
        if isinstance(exc, UnknownSegmentError):
            breaker.failure()
        else:
            breaker.trip()
        raise StreamTargetFailed(peer, f"cannot open segment {segment!r}: {exc}") from exc
    except BaseException:
        breaker.failure()
        raise
    breaker.success()
    return handle
