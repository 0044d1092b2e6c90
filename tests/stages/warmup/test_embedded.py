"""Warm-up jobs on a real embedded server over gRPC: coverage and cold-equal greedy output on
the small demo model; bad input, budget, cancel, restart, pins and replicas on the tiny one."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvflow.kvdb import Tier
from kvflow.stages.engine.model_card import ModelCard
from kvflow.stages.warmup import CorpusItem
from kvflow.stages.warmup.materialize import Materializer
from tests.stages.warmup.conftest import BLOCK, is_rpc_error

# Cancelling stops a job within about a second; the slack is for a loaded 2-core machine.
CANCEL_S = 3.0
PIN_TTL_S = 6.0

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _words(n: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    vocab = ["kv", "cache", "prefix", "block", "token", "store", "tier", "moon", "cake", "flow"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _items(n: int, words: int = 30) -> list[dict[str, Any]]:
    return [{"prompt": _words(words, seed)} for seed in range(n)]


def test_warmed_items_hit_every_full_block_with_cold_output(
    small_model: Path, make_warm: Any
) -> None:
    (small_model / "chat_template.jinja").write_text(TEMPLATE)
    w = make_warm(small_model)
    lines = [
        {"prompt": _words(40, 1)},
        {
            "messages": [
                {"role": "system", "content": _words(20, 2)},
                {"role": "user", "content": "hello"},
            ]
        },
        {"hash_ids": [11, 12, 13]},
    ]
    cluster = w.server.cluster
    mat = Materializer(
        cluster.tokenizer,
        ModelCard.from_dir(small_model).chat_template,
        BLOCK,
        cluster.tokenizer.vocab_size,
    )
    prompts = [
        mat.tokens(CorpusItem.from_dict({**x, "index": i, "source": "c", "line": i + 1}))
        for i, x in enumerate(lines)
    ]
    cold = [
        w.server.generate(p, max_tokens=6, tenant="cold", sampling={"temperature": 0.0})
        for p in prompts
    ]
    assert all(m[-1].usage.cached_tokens == 0 for m in cold)

    reply = w.submit(lines)
    status = w.wait(reply.job.job_id)
    assert status.state == "done" and dict(status.items_by_state) == {"warmed": 3}
    report = w.report(reply.job.job_id)
    assert report.totals.items_covered == 3
    assert report.totals.blocks_cached == sum(len(p) // BLOCK for p in prompts)
    assert report.totals.prefill_s_saved > 0
    for prompt, cold_msgs, row in zip(prompts, cold, report.items, strict=True):
        assert row.blocks_cached == row.blocks_total == len(prompt) // BLOCK
        assert dict(row.tiers) == {"dram": row.blocks_total} and list(row.holders) == ["prefill-0"]
        warm = w.server.generate(prompt, max_tokens=6, sampling={"temperature": 0.0})
        assert warm[-1].usage.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
        assert [t for m in warm for t in m.token_ids] == [t for m in cold_msgs for t in m.token_ids]


def test_bad_input(tiny_model: Path, make_warm: Any) -> None:
    w = make_warm(tiny_model)
    max_len = w.server.cluster.max_model_len
    too_long = {"hash_ids": list(range(max_len // BLOCK + 1))}
    reply = w.submit([{"prompt": "ok " * 30}, "{oops", too_long, {"x": 1}])
    assert list(reply.corpus_errors) == [
        "corpus.jsonl:2: not JSON: Expecting property name enclosed in double quotes (column 2)",
        "corpus.jsonl:4: no 'prompt', 'text', 'messages', 'body' or 'hash_ids' key",
    ]
    status = w.wait(reply.job.job_id)
    assert status.state == "done" and dict(status.items_by_state) == {"warmed": 1, "error": 1}
    assert any(f"over the model's maximum {max_len}" in e for e in status.errors)
    for bad in ([], ["{oops"]):
        with pytest.raises(grpc.RpcError) as err:
            w.submit(bad)
        assert is_rpc_error(err.value, grpc.StatusCode.INVALID_ARGUMENT)
        assert "no items" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        w.submit(_items(1), budget={"max_bytes": 10})
    assert "smaller than one block" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        w.stub.Status(_req("nope"))
    assert is_rpc_error(err.value, grpc.StatusCode.NOT_FOUND)


def _blocks(w: Any) -> int:
    return sum(len(p.store.shard.holdings()) for p in w.server.cluster.prefill.values())


@pytest.mark.parametrize("on_limit", ["truncate", "skip", "stop"])
def test_budget_is_never_exceeded(tiny_model: Path, make_warm: Any, on_limit: str) -> None:
    w = make_warm(tiny_model)
    dry = w.submit(_items(4), budget={"max_blocks": 5, "on_limit": on_limit}, dry_run=True)
    assert dry.estimate.blocks_to_compute <= 5 and not dry.HasField("job")
    assert _blocks(w) == 0  # a dry run computes nothing
    reply = w.submit(_items(4), budget={"max_blocks": 5, "on_limit": on_limit})
    status = w.wait(reply.job.job_id)
    assert status.state == "done"
    assert 0 < _blocks(w) <= 5 if on_limit == "truncate" else _blocks(w) == 0
    assert status.blocks_warmed == _blocks(w) == dry.estimate.blocks_to_compute
    if on_limit == "stop":
        assert status.stopped_reason == "budget limit reached"
    if on_limit == "skip":
        assert dict(status.items_by_state) == {"over_budget": 4}


def test_cancel_stops_within_a_second_and_keeps_what_is_done(
    tiny_model: Path, make_warm: Any
) -> None:
    w = make_warm(tiny_model)
    reply = w.submit(_items(60, words=60), segment_blocks=1)
    job = reply.job.job_id
    while w.stub.Status(_req(job)).items_finished < 2:
        time.sleep(0.01)
    t0 = time.monotonic()
    w.stub.Cancel(_req(job))
    status = w.wait(job, timeout_s=60)
    cluster = w.server.cluster
    # the promise is about a second; the slack is for a loaded 2-core machine
    while cluster.pipeline.in_flight():
        assert time.monotonic() - t0 < CANCEL_S
        time.sleep(0.01)
    assert status.state == "cancelled" and time.monotonic() - t0 < CANCEL_S
    assert 2 <= status.items_finished < 60
    report = w.report(job)
    done = [r for r in report.items if r.blocks_cached == r.blocks_total]
    assert len(done) >= status.items_finished


def _req(job: str) -> Any:
    from kvflow.stages.api.warmup import warmup_pb2

    return warmup_pb2.JobRequest(job_id=job)


def test_a_restart_resumes_without_redoing_finished_items(
    tiny_model: Path, make_warm: Any, tmp_path: Path
) -> None:
    data = tmp_path / "shared"
    w = make_warm(tiny_model, data)
    job = w.submit(_items(30, words=60), segment_blocks=1).job.job_id
    while w.stub.Status(_req(job)).items_finished < 3:
        time.sleep(0.01)
    w.server.close()  # interrupts the job (not a cancel)
    events = (data / "warmup" / job / "events.jsonl").read_text().splitlines()
    before = {json.loads(e)["result"]["index"] for e in events if '"kind": "item"' in e}
    assert 3 <= len(before) < 30
    w2 = make_warm(tiny_model, data)
    status = w2.wait(job)
    assert status.state == "done" and status.runs == 2 and status.items_finished == 30
    indexes = [
        json.loads(e)["result"]["index"]
        for e in (data / "warmup" / job / "events.jsonl").read_text().splitlines()
        if '"kind": "item"' in e
    ]
    assert sorted(indexes) == list(range(30))  # each item recorded once: none redone
    assert w2.report(job).totals.items_covered == 30


def test_pins_hold_blocks_in_dram_until_the_ttl(tiny_model: Path, make_warm: Any) -> None:
    w = make_warm(tiny_model)
    # the TTL outlasts the job and the checks below on a loaded machine, then lapses
    job = w.submit(_items(2), pin_ttl_s=PIN_TTL_S).job.job_id
    assert w.wait(job).state == "done"
    shard = w.server.cluster.prefill["prefill-0"].store.shard
    keys = [k for k, _ in shard.holdings()]
    assert keys and shard.num_pinned() == len(keys)
    shard.evict(Tier.DRAM, 1 << 30)  # pressure: everything evictable goes
    assert all(shard.tier_of(k) is Tier.DRAM for k in keys)
    deadline = time.monotonic() + PIN_TTL_S + 60
    while shard.num_pinned():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    shard.evict(Tier.DRAM, 1 << 30)
    assert all(shard.tier_of(k) is not Tier.DRAM for k in keys)


def test_replicas_reach_their_target(tiny_model: Path, make_warm: Any) -> None:
    w = make_warm(tiny_model, num_prefill=2)
    job = w.submit(_items(3), replicas=2).job.job_id
    assert w.wait(job).state == "done"
    deadline = time.monotonic() + 30
    while True:
        rows = w.report(job).items
        if all(r.min_replicas >= 2 and r.replica_target == 2 for r in rows):
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
