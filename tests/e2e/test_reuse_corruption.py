"""A corrupt or mis-keyed SSD block met during reuse-load: the request succeeds with the prefix
up to that block, the rest is recomputed, every pin is released and the event is counted.

Before the block checksum covered the key, the mis-keyed block was served (wrong KV, wrong
tokens); before the shard kept the pins owed on a dropped block, the corrupt one failed the
request with NotPinnedError and left the valid blocks after it pinned forever."""

from __future__ import annotations

import random

import pytest

from kvflow.kvdb import Tier, block_keys
from kvflow.stages.hash import namespace_for
from tests.e2e.conftest import BLOCK, assert_no_leaks


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.mark.parametrize("damage", ["flip", "other_key"])
def test_a_bad_ssd_block_in_the_prefix_is_recomputed_and_counted(make_server, damage):
    server = make_server()
    cluster = server.cluster
    prompt = ids(100, seed=21)  # 6 full blocks
    cold_ids, _, _ = server.generate(prompt, max_tokens=8)
    (inst,) = cluster.prefill.values()
    shard = inst.store.shard
    ns = namespace_for("", cluster.model_fingerprint, cluster.layout)
    keys = list(block_keys(ns, prompt))[:6]
    shard.evict(Tier.DRAM, 1 << 30)  # every block to SSD
    assert [shard.tier_of(k) for k in keys] == [Tier.SSD] * 6
    engine = shard._state.ssd.engine  # type: ignore[union-attr]
    if damage == "flip":
        record = bytearray(engine.get(keys[2]) or b"")
        record[len(record) // 2] ^= 0x10
        engine.put(keys[2], bytes(record))
    else:  # a valid record of another block, under block 2's key
        engine.put(keys[2], engine.get(keys[3]) or b"")
    stage = next(s for s in cluster.pipeline.stages if s.name == "reuse-load")
    before = stage.corrupt_blocks

    warm_ids, warm, _ = server.generate(prompt, max_tokens=8)

    assert warm.cached_tokens == 2 * BLOCK  # blocks 0-1; 2 onward recomputed
    assert warm_ids == cold_ids
    assert stage.corrupt_blocks == before + 1
    assert shard.stats().ssd.corruptions >= 1
    assert "kvflow_reuse_corrupt_blocks_total 1.0" in cluster.metrics.render().decode()
    assert_no_leaks(server)  # num_pinned() == 0 among the rest
    again_ids, again, _ = server.generate(prompt, max_tokens=8)  # block 2 stored again
    assert again.cached_tokens == 6 * BLOCK and again_ids == cold_ids
    assert_no_leaks(server)
