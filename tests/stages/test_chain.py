"""The five stages after hash, driven by hand on the small demo model (whose output depends on
its KV cache): route, reuse-load, prefill and stream side by side, decode. A cold run and a run
that reuses the cached prefix give the recompute reference's tokens, and every resource is
back afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.stages.decode import DecodeStage
from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.stages.prefill import PrefillStage
from kvflow.stages.reuse_load import ReuseLoadStage
from kvflow.stages.route import RouteStage
from kvflow.stages.stream import StreamStage
from tests.stages.conftest import BLOCK, Rig, context


@pytest.fixture(scope="module")
def small_rig(small_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(small_model, tmp_path_factory.mktemp("rig"), num_prefill=1)
    yield r
    r.close()


def _generate(rig: Rig, ids: list[int], rid: str) -> tuple[list[int], int]:
    e = rig.engine
    stages = [
        RouteStage(rig.conductor(), rig.prefill, rig.decode, block_size=BLOCK),
        ReuseLoadStage(rig.prefill, e.page_shape, e.page_dtype, BLOCK, peers=rig.prefill),
    ]
    prefill, stream = PrefillStage(BLOCK), StreamStage(rig.transfer, rig.pools, BLOCK)
    decode = DecodeStage(BLOCK, wait_for_prefill=False)
    state = rig.state(ids, max_tokens=6)
    ctx = context(rid, state)

    async def go() -> None:
        try:
            for stage in stages:
                await stage.run(ctx)
            task = asyncio.create_task(prefill.run(ctx))
            await stream.run(ctx)
            await task
            await decode.run(ctx)
        finally:
            for stage in [*stages, prefill, stream, decode][::-1]:
                await stage.cleanup(ctx, None)

    asyncio.run(go())
    return state.output_ids, state.num_cached_tokens


def test_cold_and_cached_runs_match_recompute_and_free_everything(small_rig: Rig) -> None:
    ids = [(i * 7919) % 30000 + 10 for i in range(5 * BLOCK + 5)]
    ref = Engine.open(small_rig.config.model_dir, EngineConfig(block_size=BLOCK, num_pages=64))  # type: ignore[arg-type]
    want = ref.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    cold, cached0 = _generate(small_rig, ids, "cold")
    warm, cached1 = _generate(small_rig, ids, "warm")
    assert cached0 == 0 and cached1 == 5 * BLOCK
    assert cold == want and warm == want
    prefill = small_rig.prefill["prefill-0"]
    decode = small_rig.decode["decode-0"]
    assert prefill.store.shard.num_pinned() == 0
    assert prefill.worker.call(lambda e: e.num_free_pages).result(10) == 128
    assert decode.worker.call(lambda e: e.num_free_pages).result(10) == 128
    assert decode.staging.num_free == 64
    assert prefill.state.queued_requests == 0 and decode.state.decode_batch_size == 0
