"""route: pick (prefill, decode) instances with the conductor, or reject the request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvflow.pipeline import RequestContext, Stage
from kvflow.router import (
    Conductor,
    InstanceState,
    Rejection,
    RejectReason,
    RouteDecision,
    RouteRequest,
)
from kvflow.stages.errors import Rejected
from kvflow.stages.runtime.instances import DecodeInstance
from kvflow.stages.state import GenerateState, StreamTarget

logger = logging.getLogger(__name__)


WAIT_POLL_S = 0.25


async def route_or_wait(
    conductor: Conductor,
    req: RouteRequest,
    instances: Callable[[], tuple[list[InstanceState], list[InstanceState]]],
    wait_s: float,
    on_wait: Callable[[], None] | None = None,
) -> RouteDecision | Rejection:
    """The conductor's decision; while there is no healthy instance of a kind (a node is
    restarting), wait up to ``wait_s`` for one before giving up (``on_wait`` is called once
    when a request starts waiting). SLO rejections are final."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        prefill, decode = instances()
        result = conductor.route(req, prefill, decode, now=time.monotonic())
        no_instance = isinstance(result, Rejection) and result.reason is RejectReason.NO_INSTANCE
        if not no_instance or time.monotonic() >= deadline:
            if waited and not no_instance:
                logger.info("req=%s: an instance is back; routed", req.request_id)
            return result
        if not waited:
            if on_wait is not None:
                on_wait()
            logger.warning(
                "req=%s: no healthy prefill or decode instance; waiting up to %.0f s",
                req.request_id,
                wait_s,
            )
            waited = True
        await asyncio.sleep(WAIT_POLL_S)


async def route_and_commit(
    conductor: Conductor,
    state: GenerateState,
    request_id: str,
    instances: Callable[[], tuple[Mapping[str, Any], Mapping[str, Any]]],
    wait_s: float,
    on_wait: Callable[[], None] | None = None,
    on_reject: Callable[[Rejection], None] | None = None,
) -> RouteDecision:
    """Route the request (waiting up to ``wait_s`` for a healthy instance) and book the
    decision through ``state.booking`` (releasing an earlier booking first: a re-route).
    Fills ``state.decision``, ``state.prefill``, ``state.decode``; raises Rejected.

    ``instances()`` returns (prefill, decode) mappings id -> instance; an instance is anything
    with an ``InstanceState`` as ``.state`` (an in-process instance or a router's RemoteNode).
    The one place a request is routed, for RouteStage and the router's re-route alike."""
    state.booking.release()

    def states() -> tuple[list[InstanceState], list[InstanceState]]:
        prefill, decode = instances()
        return [p.state for p in prefill.values()], [d.state for d in decode.values()]

    req = RouteRequest(request_id, tuple(state.block_keys), state.prompt_len)
    result = await route_or_wait(conductor, req, states, wait_s, on_wait)
    if isinstance(result, Rejection):
        if on_reject is not None:
            on_reject(result)
        raise Rejected(result)
    prefill_map, decode_map = instances()
    prefill, decode = prefill_map[result.prefill_id], decode_map[result.decode_id]
    state.booking.commit(result, prefill.state, decode.state)
    state.decision, state.prefill, state.decode = result, prefill, decode
    state.pull, state.pulls_decided = result.pull, conductor.decides_pulls
    return result


class RouteStage(Stage):
    """Fills ``state.decision``, ``state.prefill`` and ``state.decode`` and books the decision
    (``state.booking``). Raises Rejected when an SLO cannot be met, or when no healthy
    instance of a kind appears within ``instance_wait_s``.

    ``block_size`` given (the embedded server, where the decode instance is in this
    process): also leases the decode instance's staging slots for the prompt's pages and sets
    ``state.stream_target`` to them (not when the two instances share one engine:
    ``state.colocated``, the decode adopts the prefill's pages). None (a router): the
    remote-generate stage reserves them on the decode node. Cleanup releases the booking and
    any staging slots still held."""

    name = "route"

    def __init__(
        self,
        conductor: Conductor,
        prefill: Mapping[str, Any],
        decode: Mapping[str, Any],
        on_reject: Callable[[Rejection], None] | None = None,
        instance_wait_s: float = 0.0,
        on_wait: Callable[[], None] | None = None,
        block_size: int | None = None,
    ) -> None:
        self._conductor = conductor
        self._prefill = prefill
        self._decode = decode
        self._on_reject = on_reject
        self._instance_wait_s = instance_wait_s
        self._on_wait = on_wait
        self._block_size = block_size

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        result = await route_and_commit(
            self._conductor,
            state,
            ctx.request_id,
            lambda: (self._prefill, self._decode),
            self._instance_wait_s,
            self._on_wait,
            self._on_reject,
        )
        if self._block_size is not None and not state.colocated:
            lease_local_staging(state, self._block_size)
        ctx.set_attrs(
            prefill=result.prefill_id,
            decode=result.decode_id,
            local_prefix_blocks=result.local_prefix_blocks,
            reused_blocks=result.reused_blocks,
            pull_blocks=0 if result.pull is None else result.pull.num_blocks,
            predicted_ttft_ms=round(result.ttft_s * 1000.0, 3),
        )

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        state: GenerateState = ctx.state
        state.booking.release()
        state.release_staging()


def lease_local_staging(state: GenerateState, block_size: int) -> None:
    """Lease the in-process decode instance's staging slots for the prompt's pages and point
    ``state.stream_target`` at them (NoCapacity when too few are free)."""
    decode: DecodeInstance = state.decode  # type: ignore[assignment]
    staging = decode.staging
    assert staging.segment is not None, "decode staging is a transfer segment"
    state.staging = staging.lease(-(-state.prompt_len // block_size))
    offsets = [staging.offset(s) for s in state.staging.slots]
    state.stream_target = StreamTarget(staging.segment, offsets, staging.page_nbytes)
