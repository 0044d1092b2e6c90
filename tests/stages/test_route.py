"""RouteStage alone: the decision, its booking through ``state.booking``, local staging when
built for the embedded server, rejection, and a cleanup that releases everything once."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.stages.errors import Rejected
from kvflow.stages.route import RouteStage
from tests.stages.conftest import BLOCK, Rig, context


def _run(stage: RouteStage, ctx) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(stage.run(ctx))


def test_route_books_the_decision_and_cleanup_releases_it_once(rig: Rig) -> None:
    stage = RouteStage(rig.conductor(), rig.prefill, rig.decode)
    state = rig.state(list(range(3, 100)))
    ctx = context("r1", state)
    _run(stage, ctx)
    assert state.decision is not None and state.prefill is not None and state.decode is not None
    assert state.prefill.state.queued_requests == 1
    assert state.decode.state.decode_batch_size == 1
    assert state.stream_target is None and state.staging is None  # a router's route
    asyncio.run(stage.cleanup(ctx, None))
    asyncio.run(stage.cleanup(ctx, None))  # idempotent
    assert state.prefill.state.queued_requests == 0
    assert state.decode.state.decode_batch_size == 0


def test_embedded_route_leases_the_decode_staging_and_sets_the_stream_target(rig: Rig) -> None:
    stage = RouteStage(rig.conductor(), rig.prefill, rig.decode, block_size=BLOCK)
    state = rig.state(list(range(3, 100)))  # 97 tokens: 7 pages
    ctx = context("r2", state)
    staging = rig.decode["decode-0"].staging
    free = staging.num_free
    _run(stage, ctx)
    assert state.staging is not None and len(state.staging.slots) == 7
    assert state.stream_target is not None and len(state.stream_target.offsets) == 7
    assert staging.num_free == free - 7
    asyncio.run(stage.cleanup(ctx, None))
    assert staging.num_free == free


def test_a_request_that_cannot_meet_its_slo_is_rejected_with_nothing_booked(rig: Rig) -> None:
    rejections = []
    stage = RouteStage(
        rig.conductor(ttft_slo_s=1e-9), rig.prefill, rig.decode, on_reject=rejections.append
    )
    state = rig.state(list(range(3, 300)))
    with pytest.raises(Rejected):
        _run(stage, context("r3", state))
    assert len(rejections) == 1
    assert all(p.state.queued_requests == 0 for p in rig.prefill.values())
    assert rig.decode["decode-0"].state.decode_batch_size == 0


def test_a_second_route_of_the_same_request_moves_its_booking(rig: Rig) -> None:
    """The router's re-route (route_and_commit) releases the first booking before the new."""
    from kvflow.stages.route import route_and_commit

    conductor = rig.conductor()
    state = rig.state(list(range(3, 100)))
    ctx = context("r4", state)

    async def twice() -> None:
        for _ in range(2):
            await route_and_commit(
                conductor, state, ctx.request_id, lambda: (rig.prefill, rig.decode), 0.0
            )

    asyncio.run(twice())
    assert sum(p.state.queued_requests for p in rig.prefill.values()) == 1
    assert rig.decode["decode-0"].state.decode_batch_size == 1
    state.booking.release()
    assert sum(p.state.queued_requests for p in rig.prefill.values()) == 0
