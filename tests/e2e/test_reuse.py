"""A prefix computed once is reused: cached tokens reported, output unchanged."""

from __future__ import annotations

import random

from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from tests.e2e.conftest import BLOCK, assert_no_leaks


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def test_repeat_reuses_every_shared_full_block_and_keeps_greedy_output(make_server, tiny_model):
    server = make_server()
    prompt = ids(100, seed=1)  # 6 full blocks of 16 + 4 tokens
    cold_ids, cold, _ = server.generate(prompt, max_tokens=12)
    warm_ids, warm, _ = server.generate(prompt, max_tokens=12)
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == (len(prompt) // BLOCK) * BLOCK == 96
    assert {t.tier: t.tokens for t in warm.cached_by_tier} == {"dram": 96}
    assert warm.prompt_tokens == cold.prompt_tokens == 100
    assert warm_ids == cold_ids and len(warm_ids) == 12
    # The same model run directly (one engine, no disaggregation, no cache) agrees.
    engine = Engine.open(tiny_model, EngineConfig(block_size=BLOCK, num_pages=64))
    direct = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert direct == cold_ids
    assert_no_leaks(server)


def test_block_aligned_prompt_recomputes_only_its_last_block(make_server):
    server = make_server()
    prompt = ids(64, seed=2)  # exactly 4 blocks: the last one must be computed for logits
    first, _, _ = server.generate(prompt)
    again, usage, _ = server.generate(prompt)
    assert usage.cached_tokens == 48
    assert again == first


def test_shared_prefix_with_a_different_suffix(make_server):
    server = make_server()
    system = ids(70, seed=3)
    server.generate(system + ids(20, seed=4))
    _, usage, _ = server.generate(system + ids(25, seed=5))
    assert usage.cached_tokens == 64  # the 4 full blocks inside the shared 70 tokens


def test_text_prompt_round_trip_and_cache(make_server):
    server = make_server()
    text = "kvflow trades storage for computation. " * 6
    ids1, u1, text1 = server.generate(text, max_tokens=6)
    ids2, u2, text2 = server.generate(text, max_tokens=6)
    assert u1.cached_tokens == 0 and u2.cached_tokens > 0
    assert (ids1, text1) == (ids2, text2)
    assert server.cluster.tokenizer.decode(ids1) == text1


def test_tenants_never_share_blocks(make_server):
    server = make_server()
    prompt = ids(80, seed=6)
    _, a1, _ = server.generate(prompt, tenant="alice")
    _, b1, _ = server.generate(prompt, tenant="bob")
    _, a2, _ = server.generate(prompt, tenant="alice")
    _, b2, _ = server.generate(prompt, tenant="bob")
    assert (a1.cached_tokens, b1.cached_tokens) == (0, 0)
    assert a2.cached_tokens == b2.cached_tokens == 64
    assert_no_leaks(server)


def test_restart_keeps_the_cache_on_ssd(tiny_model, tmp_path):
    from tests.e2e.conftest import ServerThread, base_config

    config = base_config(tiny_model, tmp_path / "data")
    prompt = ids(90, seed=7)
    first = ServerThread(config)
    try:
        out1, _, _ = first.generate(prompt)
    finally:
        first.close()
    second = ServerThread(config)
    try:
        out2, usage, _ = second.generate(prompt)
    finally:
        second.close()
    assert usage.cached_tokens == 80
    assert {t.tier: t.tokens for t in usage.cached_by_tier} == {"ssd": 80}
    assert out2 == out1


def test_a_follow_up_turn_reuses_the_answer_the_decode_instance_generated(make_server, tiny_model):
    server = make_server()
    prompt = ids(70, seed=8)
    answer, first, _ = server.generate(prompt, max_tokens=40, sampling=_no_eos())
    assert len(answer) == 40 and first.cached_tokens == 0
    follow_up = prompt + answer + ids(10, seed=9)  # 120 tokens
    out, usage, _ = server.generate(follow_up, max_tokens=8)
    # 4 prompt blocks from the prefill shard, then blocks 4-5 (the answer's KV, computed
    # by the decode instance) pulled from the decode shard.
    assert usage.cached_tokens == 96
    assert {t.tier: t.tokens for t in usage.cached_by_tier} == {"dram": 64, "remote": 32}
    engine = Engine.open(tiny_model, EngineConfig(block_size=BLOCK, num_pages=64))
    assert out == engine.generate([follow_up], SamplingParams(max_tokens=8))[0]
    decode_shard = server.cluster.decode["decode-0"].store.shard
    assert decode_shard.stats().dram.blocks == 2
    assert_no_leaks(server)


def _no_eos():
    from kvflow.stages.api import pb2

    return pb2.SamplingParams(ignore_eos=True)
