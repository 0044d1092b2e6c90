"""ReuseLoadStage alone, over real in-memory shards: the local prefix (pinned, read into the
instance's load staging), the conductor's planned pull (exactly the plan), the greedy
continuation only for a cache-blind policy or as the fallback of a failed plan, and a cleanup
that unpins and returns every slot."""

from __future__ import annotations

import asyncio

import torch

from kvflow.router import PullPlan
from kvflow.stages.reuse_load import ReuseLoadStage
from kvflow.stages.state import GenerateState
from tests.stages.conftest import BLOCK, Rig, context

PROMPT = list(range(5, 5 + 12 * BLOCK + 3))  # 12 usable blocks


def _store(rig: Rig, instance: str, state: GenerateState, n: int) -> list[torch.Tensor]:
    """Put ``n`` leading blocks of the prompt (random pages) in ``instance``'s shard."""
    gen = torch.Generator().manual_seed(n)
    pages = [
        torch.randn(rig.engine.page_shape, generator=gen).to(rig.engine.page_dtype)
        for _ in range(n)
    ]
    client = rig.prefill[instance].client(state.namespace)  # type: ignore[arg-type]
    keys = state.block_keys[:n]
    client.batch_put(keys, pages, parents=[None, *keys[:-1]])
    return pages


def _stage(rig: Rig) -> ReuseLoadStage:
    e = rig.engine
    return ReuseLoadStage(
        rig.prefill, e.page_shape, e.page_dtype, BLOCK, peers={**rig.prefill, **rig.decode}
    )


def _run(rig: Rig, state: GenerateState, on: str) -> tuple[ReuseLoadStage, object]:
    state.prefill = rig.prefill[on]
    stage = _stage(rig)
    ctx = context("req", state)
    asyncio.run(stage.run(ctx))
    return stage, ctx


def test_the_local_prefix_is_pinned_read_and_released(rig: Rig) -> None:
    state = rig.state(PROMPT)
    pages = _store(rig, "prefill-0", state, 7)
    stage, ctx = _run(rig, state, "prefill-0")
    assert state.num_cached_tokens == 7 * BLOCK and state.pulled_tokens == 0
    assert state.cached_by_tier == {"dram": 7 * BLOCK}
    assert all(torch.equal(a, b) for a, b in zip(state.prefix_pages, pages, strict=True))
    shard = rig.prefill["prefill-0"].store.shard
    load = rig.prefill["prefill-0"].load_staging
    assert shard.num_pinned() == 7 and load is not None and load.num_free == 64 - 7
    asyncio.run(stage.cleanup(ctx, None))  # type: ignore[arg-type]
    assert shard.num_pinned() == 0 and load.num_free == 64


def test_a_planned_pull_copies_exactly_the_plan(rig: Rig) -> None:
    state = rig.state(PROMPT)
    pages = _store(rig, "prefill-0", state, 12)
    state.pull, state.pulls_decided = PullPlan("prefill-0", 0, 5), True
    stage, ctx = _run(rig, state, "prefill-1")
    assert state.pulled_tokens == 5 * BLOCK and state.num_cached_tokens == 5 * BLOCK
    assert state.cached_by_tier == {"remote": 5 * BLOCK}
    assert all(torch.equal(a, b) for a, b in zip(state.prefix_pages, pages, strict=False))
    assert rig.prefill["prefill-1"].match_prefix(state.block_keys) == 5  # replicated
    asyncio.run(stage.cleanup(ctx, None))  # type: ignore[arg-type]


def test_when_the_policy_decides_pulls_no_plan_means_no_pull(rig: Rig) -> None:
    state = rig.state(PROMPT)
    _store(rig, "prefill-0", state, 12)
    state.pulls_decided = True
    stage, ctx = _run(rig, state, "prefill-1")
    assert state.num_cached_tokens == 0 and state.pulled_tokens == 0
    assert rig.prefill["prefill-1"].match_prefix(state.block_keys) == 0
    asyncio.run(stage.cleanup(ctx, None))  # type: ignore[arg-type]


def test_a_cache_blind_policy_continues_from_any_holder(rig: Rig) -> None:
    state = rig.state(PROMPT)
    _store(rig, "prefill-0", state, 12)
    stage, ctx = _run(rig, state, "prefill-1")  # pulls_decided False: round-robin & co.
    assert state.pulled_tokens == 12 * BLOCK and state.num_cached_tokens == 12 * BLOCK
    asyncio.run(stage.cleanup(ctx, None))  # type: ignore[arg-type]


def test_a_plan_the_holder_cannot_serve_falls_back_to_other_holders(rig: Rig) -> None:
    """The plan names prefill-0, which lost the blocks (evicted after the decision); the decode
    shard holds them: the fallback reads them from there."""
    state = rig.state(PROMPT)
    keys = state.block_keys[:6]
    pages = [torch.zeros(rig.engine.page_shape, dtype=rig.engine.page_dtype) for _ in keys]
    rig.decode["decode-0"].client(state.namespace).batch_put(  # type: ignore[arg-type]
        keys, pages, parents=[None, *keys[:-1]]
    )
    state.pull, state.pulls_decided = PullPlan("prefill-0", 0, 6), True
    stage, ctx = _run(rig, state, "prefill-1")
    assert state.pulled_tokens == 6 * BLOCK and state.num_cached_tokens == 6 * BLOCK
    asyncio.run(stage.cleanup(ctx, None))  # type: ignore[arg-type]
    assert rig.prefill["prefill-1"].store.shard.num_pinned() == 0


def test_requests_of_one_prefix_at_once_read_it_once(rig: Rig) -> None:
    """Two requests whose prompts share 7 cached blocks and then differ, run together: one
    read into the load staging, the same buffers for both; the slots go back after the
    second cleanup, every pin dropped. A third, with nothing held any more, reads again."""
    states = [rig.state(PROMPT[: 7 * BLOCK] + [900 + i] * (2 * BLOCK)) for i in range(3)]
    pages = _store(rig, "prefill-0", states[0], 7)
    stage = _stage(rig)
    load = rig.prefill["prefill-0"].load_staging
    shard = rig.prefill["prefill-0"].store.shard
    assert load is not None

    async def both() -> list[object]:
        ctxs = []
        for i, state in enumerate(states[:2]):
            state.prefill = rig.prefill["prefill-0"]
            ctxs.append(context(f"req-{i}", state))
        await asyncio.gather(*(stage.run(c) for c in ctxs))  # type: ignore[arg-type]
        return ctxs

    ctxs = asyncio.run(both())
    a, b = states[:2]
    assert a.num_cached_tokens == b.num_cached_tokens == 7 * BLOCK
    assert all(x is y for x, y in zip(a.prefix_pages, b.prefix_pages, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a.prefix_pages, pages, strict=True))
    assert load.num_free == 64 - 7 and shard.num_pinned() == 7
    asyncio.run(stage.cleanup(ctxs[0], None))  # type: ignore[arg-type]
    assert load.num_free == 64 - 7  # b still holds the buffers
    asyncio.run(stage.cleanup(ctxs[1], None))  # type: ignore[arg-type]
    assert load.num_free == 64 and shard.num_pinned() == 0
    c = states[2]
    c.prefill = rig.prefill["prefill-0"]
    ctx = context("req-2", c)
    asyncio.run(stage.run(ctx))
    assert c.num_cached_tokens == 7 * BLOCK and load.num_free == 64 - 7
    assert (stage._loads.reads, stage._loads.joins) == (2, 1)
    asyncio.run(stage.cleanup(ctx, None))  # type: ignore[arg-type]
    assert load.num_free == 64
