"""route: pick (prefill, decode) instances with the conductor, or reject the request."""

from __future__ import annotations

import asyncio
import contextlib
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
    UnknownInstanceError,
)
from kvflow.stages.errors import Rejected
from kvflow.stages.runtime.instances import DecodeInstance, PrefillInstance
from kvflow.stages.state import GenerateState

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


class RouteStage(Stage):
    """Fills ``state.decision``, ``state.prefill`` and ``state.decode``; commits the decision to
    the instances' queues. Raises Rejected when an SLO cannot be met, or when no healthy
    instance of a kind appears within ``instance_wait_s``. Cleanup takes the request off both
    instances' books if the later stages have not already."""

    name = "route"

    def __init__(
        self,
        conductor: Conductor,
        prefill: Mapping[str, PrefillInstance],
        decode: Mapping[str, DecodeInstance],
        on_reject: Any = None,
        instance_wait_s: float = 0.0,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        self._conductor = conductor
        self._prefill = prefill
        self._decode = decode
        self._on_reject = on_reject
        self._instance_wait_s = instance_wait_s
        self._on_wait = on_wait

    def _states(self) -> tuple[list[InstanceState], list[InstanceState]]:
        return [p.state for p in self._prefill.values()], [d.state for d in self._decode.values()]

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        req = RouteRequest(ctx.request_id, tuple(state.block_keys), state.prompt_len)
        result = await route_or_wait(
            self._conductor, req, self._states, self._instance_wait_s, self._on_wait
        )
        if isinstance(result, Rejection):
            if self._on_reject is not None:
                self._on_reject(result)
            raise Rejected(result)
        prefill = self._prefill[result.prefill_id]
        decode = self._decode[result.decode_id]
        self._conductor.commit(result, prefill.state, decode.state)
        state.decision, state.prefill, state.decode = result, prefill, decode
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
        if state.prefill is not None:
            release_prefill_slot(state, ctx.request_id)
        if state.decode is not None:
            with contextlib.suppress(UnknownInstanceError):
                state.decode.state.remove_decode(ctx.request_id)


def release_prefill_slot(state: GenerateState, request_id: str) -> None:
    """Take the request off its prefill instance's queue (idempotent)."""
    if state.prefill is None:
        return
    with contextlib.suppress(UnknownInstanceError):
        state.prefill.state.finish(request_id)
