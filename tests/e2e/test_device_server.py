"""The embedded server with its engines on a GPU (``--device cuda``): the same pipeline, with
pages stored and streamed from each engine's host mirror of its pool (`Engine.host_pool`).

Never in the default run (marker ``gpu``); ``pytest -m gpu tests/e2e/test_device_server.py``
on a machine with a GPU. The device comes from ``KVFLOW_TEST_DEVICE`` (``cuda`` unless set),
so the same checks can be tried on ``cpu``. The small demo model, whose outputs depend on its
KV: cached == recomputed is a real check.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvflow.stages.api import pb2
from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from tests.device import DEVICE, MARKS
from tests.e2e.conftest import BLOCK, ServerThread, assert_no_leaks, base_config

pytestmark = MARKS


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.mark.parametrize("colocate", [False, True], ids=["disaggregated", "colocated"])
def test_a_server_on_the_device_matches_its_engine_and_reuses_its_cache(
    small_model: Path, tmp_path: Path, colocate: bool
) -> None:
    server = ServerThread(base_config(small_model, tmp_path, device=DEVICE, colocate=colocate))
    try:
        cluster = server.cluster
        for inst in [*cluster.prefill.values(), *cluster.decode.values()]:
            engine = inst.worker.engine
            assert {p.device.type for p in engine.model.parameters()} == {torch.device(DEVICE).type}
            assert engine.host_pool.device.type == "cpu"
        prompts = [ids(100, seed=1), ids(150, seed=2), ids(40, seed=3)]
        with ThreadPoolExecutor(len(prompts)) as pool:  # streams decode while others prefill
            cold = list(pool.map(lambda p: server.generate(p, max_tokens=12), prompts))
        warm_ids, warm, _ = server.generate(prompts[1], max_tokens=12)
        direct_engine = Engine.open(
            small_model,
            EngineConfig(block_size=BLOCK, num_pages=128, prefill_chunk=64, device=DEVICE),
        )
        direct = direct_engine.generate(prompts, SamplingParams(max_tokens=12))
        assert [c[0] for c in cold] == direct  # served == a plain engine on the device
        assert warm.cached_tokens == (150 // BLOCK) * BLOCK  # read back through the host
        assert warm_ids == direct[1]  # cached == recomputed

        # a follow-up turn: the answer's KV, computed on the device by the decode instance,
        # was stored from its host mirror and is read back with the prompt's
        prompt = ids(70, seed=8)
        answer, _, _ = server.generate(prompt, max_tokens=40, sampling=_no_eos())
        follow_up = prompt + answer + ids(10, seed=9)  # 120 tokens
        out, usage, _ = server.generate(follow_up, max_tokens=8)
        assert usage.cached_tokens == 96  # 4 prompt blocks and 2 of the answer's
        assert out == direct_engine.generate([follow_up], SamplingParams(max_tokens=8))[0]
        assert_no_leaks(server)
    finally:
        server.close()


def _no_eos() -> pb2.SamplingParams:
    return pb2.SamplingParams(ignore_eos=True)
