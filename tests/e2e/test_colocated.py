"""The embedded server with --colocate: one engine serves the prefill and the decode stage.

The pipeline is the same (KV still goes to kvdb and is reused), so the outputs equal a plain
engine's, a repeat is served from the cache with the same tokens, and concurrent requests
decode while another prompt is prefilled in chunks, in one engine.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from tests.e2e.conftest import BLOCK, assert_no_leaks


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.mark.slow
def test_colocated_server_shares_one_engine_and_matches_a_plain_engine(
    make_server, tiny_model, monkeypatch
):
    server = make_server(colocate=True, prefill_chunk=32)
    cluster = server.cluster
    prefill, decode = cluster.prefill["prefill-0"], cluster.decode["decode-0"]
    assert prefill.worker is decode.worker  # one engine, one copy of the weights
    assert prefill.worker.engine.num_pages == 2 * server.config.num_pages
    leases: list[int] = []
    lease = decode.staging.lease
    monkeypatch.setattr(decode.staging, "lease", lambda n: leases.append(n) or lease(n))

    prompts = [ids(100, seed=1), ids(150, seed=2), ids(20, seed=3), ids(70, seed=4)]
    with ThreadPoolExecutor(len(prompts)) as pool:  # decode and chunked prefill at once
        cold = list(pool.map(lambda p: server.generate(p, max_tokens=12), prompts))
    warm_ids, warm, _ = server.generate(prompts[0], max_tokens=12)

    engine = Engine.open(tiny_model, EngineConfig(block_size=BLOCK, num_pages=128))
    direct = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert [c[0] for c in cold] == direct  # cached == recomputed == a plain engine
    assert warm.cached_tokens == (100 // BLOCK) * BLOCK
    assert warm_ids == direct[0]
    one_ids, _, _ = server.generate(prompts[3], max_tokens=1)  # no decode adopts the prefill's
    assert one_ids == direct[3][:1]
    assert leases == []  # the decode adopted the prefill's pages: nothing staged or streamed
    assert_no_leaks(server)


def test_colocate_needs_pairs(tiny_model, tmp_path):
    from tests.e2e.conftest import base_config

    with pytest.raises(ValueError, match=r"num_prefill \(2\) must equal num_decode \(1\)"):
        base_config(tiny_model, tmp_path, colocate=True, num_prefill=2, num_decode=1)
