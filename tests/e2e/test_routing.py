"""The conductor with two prefill instances: locality, pulls from an overloaded holder, SLOs."""

from __future__ import annotations

import time

import grpc
import pytest

from kvflow.stages.api import pb2
from tests.e2e.conftest import BLOCK, assert_no_leaks
from tests.e2e.test_reuse import ids


def test_repeat_goes_to_the_holder_and_pulls_when_it_is_overloaded(make_server):
    server = make_server(num_prefill=2)
    cluster = server.cluster
    prompt = ids(200, seed=10)
    out1, u1, _ = server.generate(prompt)
    holder = u1.prefill_instance
    other = next(p for p in cluster.prefill if p != holder)

    out2, u2, _ = server.generate(prompt)
    assert u2.prefill_instance == holder
    assert u2.cached_tokens == 192 and u2.pulled_tokens == 0

    # Make the holder look busy: 100 s of predicted prefill queued on it.
    cluster.prefill[holder].state.enqueue("synthetic-load", 100.0)
    try:
        out3, u3, _ = server.generate(prompt)
    finally:
        cluster.prefill[holder].state.finish("synthetic-load")
    assert u3.prefill_instance == other
    assert u3.pulled_tokens == 192 and u3.cached_tokens == 192
    assert {t.tier: t.tokens for t in u3.cached_by_tier} == {"remote": 192}
    assert out1 == out2 == out3

    # The pull replicated the blocks: both shards hold them, and the metadata says so.
    keys = _keys(cluster, prompt)
    assert cluster.prefill[other].match_prefix(keys) == len(keys)
    view = cluster.metadata.view()
    deadline = time.monotonic() + 30
    while view.replica_count(keys[0]) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert view.replica_count(keys[0]) == 2
    assert_no_leaks(server)


def _keys(cluster, prompt):
    from kvflow.kvdb import block_keys

    return block_keys(cluster.namespace("default"), prompt)[: (len(prompt) - 1) // BLOCK]


def test_round_robin_policy_alternates(make_server):
    server = make_server(num_prefill=2, policy="round-robin")
    chosen = [server.generate(ids(20, seed=s))[1].prefill_instance for s in range(4)]
    assert chosen == ["prefill-0", "prefill-1", "prefill-0", "prefill-1"]


def test_ttft_slo_rejects_with_the_predictions(make_server):
    server = make_server(ttft_slo_s=1e-6)
    with pytest.raises(grpc.RpcError) as err:
        server.generate(ids(40, seed=11))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "predicted TTFT" in err.value.details() and "SLO" in err.value.details()
    rejections = server.cluster.metrics.render().decode()
    assert 'kvflow_rejections_total{reason="ttft_slo"} 1.0' in rejections
    assert_no_leaks(server)


def test_tbt_slo_rejects(make_server):
    server = make_server(tbt_slo_s=1e-9)
    with pytest.raises(grpc.RpcError) as err:
        server.generate(ids(40, seed=12))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "predicted TBT" in err.value.details()


def test_health_and_stats(server):
    health = server.stub.Health(pb2.HealthRequest(), timeout=10)
    assert health.serving and health.block_size == BLOCK
    assert list(health.prefill_instances) == ["prefill-0"]
    server.generate(ids(40, seed=13))
    stats = server.stub.Stats(pb2.StatsRequest(), timeout=10)
    kinds = {i.instance_id: i.kind for i in stats.instances}
    assert kinds == {"prefill-0": "prefill", "decode-0": "decode"}
    prefill = next(i for i in stats.instances if i.kind == "prefill")
    assert prefill.values["dram_blocks"] >= 2


def test_change_replica_copies_the_block_to_another_shard(make_server):
    server = make_server(num_prefill=2)
    cluster = server.cluster
    prompt = ids(80, seed=14)
    _, usage, _ = server.generate(prompt)
    holder = usage.prefill_instance
    other = next(p for p in cluster.prefill if p != holder)
    keys = _keys(cluster, prompt)
    client = cluster.prefill[holder].client(cluster.namespace("default"))
    client.change_replica(keys[0], 2)
    view = cluster.metadata.view()
    deadline = time.monotonic() + 10
    while view.replica_count(keys[0]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert view.replica_count(keys[0]) == 2
    assert cluster.prefill[other].store.shard.exists(keys[0])
    assert not cluster.prefill[other].store.shard.exists(keys[1])  # only the block asked for
    assert view.replica_target(keys[0]) == 2


def test_below_the_balancing_threshold_the_chosen_instance_pulls_nothing(make_server):
    """Cache-aware routing decides pulls: an instance chosen with no pull plan reuses only its
    own prefix, even when another prefill instance holds more (no greedy continuation)."""
    server = make_server(num_prefill=2)
    cluster = server.cluster
    prompt = ids(200, seed=12)  # 12 usable blocks
    _, u1, _ = server.generate(prompt)
    holder = u1.prefill_instance
    other = next(p for p in cluster.prefill if p != holder)
    cluster.prefill[holder].state.enqueue("synthetic-load", 100.0)
    try:
        # The other instance gets the first 6 blocks (a planned pull: 6 > 2 x 0)...
        _, u2, _ = server.generate(prompt[:100] + ids(40, seed=13))
        assert u2.prefill_instance == other and u2.pulled_tokens == 96
        # ...then the whole prompt: 12 blocks is not > 2 x 6, so no pull is planned.
        _, u3, _ = server.generate(prompt)
    finally:
        cluster.prefill[holder].state.finish("synthetic-load")
    assert u3.prefill_instance == other
    assert u3.cached_tokens == 96 and u3.pulled_tokens == 0
    keys = _keys(cluster, prompt)
    assert cluster.prefill[other].match_prefix(keys) == len(keys)  # computed the rest itself
    view = cluster.metadata.view()  # its own copies reach the metadata asynchronously
    deadline = time.monotonic() + 30
    while view.replica_count(keys[8]) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert view.replica_count(keys[8]) == 2  # computed by the other instance, not pulled
    assert_no_leaks(server)
