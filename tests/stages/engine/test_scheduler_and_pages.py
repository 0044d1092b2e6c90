"""The scheduling policy and the page pool, tested alone."""

from __future__ import annotations

import pytest
import torch

from kvflow.stages.engine import OutOfPagesError, PageLayoutError, SamplingParams
from kvflow.stages.engine.pages import KVLayout, PagePool
from kvflow.stages.engine.scheduler import plan_step, tail_slack
from kvflow.stages.engine.sequence import Phase, Sequence


def _seq(rid: str, n_tokens: int, computed: int, arrival: int, last: int = -1) -> Sequence:
    return Sequence(
        request_id=rid,
        token_ids=list(range(n_tokens)),
        prompt_len=n_tokens,
        sampling=SamplingParams(),
        pages=[],
        num_computed=computed,
        stop_ids=frozenset(),
        max_len=1000,
        retain_pages=False,
        arrival=arrival,
        last_decode_step=last,
    )


def test_prefill_budget_is_shared_in_arrival_order() -> None:
    a, b, c = _seq("a", 100, 0, 0), _seq("b", 40, 0, 1), _seq("c", 10, 0, 2)
    plan = plan_step([a, b, c], prefill_budget=120, max_batch=4)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("a", 100), ("b", 20)]
    assert plan.decode == ()


def test_decode_batch_capped_and_rotates() -> None:
    seqs = [_seq(f"d{i}", 10, 9, i, last=5 if i < 2 else 3) for i in range(4)]
    assert all(s.phase is Phase.DECODE for s in seqs)
    plan = plan_step(seqs, prefill_budget=8, max_batch=3)
    assert [s.request_id for s in plan.decode] == ["d2", "d3", "d0"]


def test_prefill_and_decode_in_one_step() -> None:
    p, d = _seq("p", 50, 10, 0), _seq("d", 20, 19, 1)
    plan = plan_step([p, d], prefill_budget=16, max_batch=8)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("p", 15)]  # 15 + 1 rows
    assert [s.request_id for s in plan.decode] == ["d"]


def test_a_steps_decode_rows_count_against_its_budget() -> None:
    """Beside a decode batch the prompt tokens and the decode rows together fill a fixed
    budget (the step's linears run all of its rows), the batch taking at most half of it; a
    budget sized by a step-time target already holds the batch's cost and is not reduced."""
    long = _seq("long", 5000, 0, 0)
    running = [_seq(f"d{i}", 10, 9, i + 1) for i in range(28)]
    plan = plan_step([long, *running], prefill_budget=1024, max_batch=32)
    assert [n for _, n in plan.prefill] == [1024 - 28] and len(plan.decode) == 28
    # the batch's cap bounds the rows it takes
    plan = plan_step([long, *running], prefill_budget=1024, max_batch=8)
    assert [n for _, n in plan.prefill] == [1016] and len(plan.decode) == 8
    # at most half of a small budget goes to the decode rows
    plan = plan_step([long, *running], prefill_budget=40, max_batch=32)
    assert [n for _, n in plan.prefill] == [20] and len(plan.decode) == 28
    # with a queue of prompts, the queued budget is the one filled
    queue = [_seq(f"q{i}", 600, 0, i) for i in range(4)]
    plan = plan_step([*queue, *running], 1024, 32, mixed_budget=512, queued_budget=1024)
    assert sum(n for _, n in plan.prefill) == 1024 - 28
    # a budget sized by time is taken as it is
    plan = plan_step([long, *running], 1024, 32, mixed_budget=300, timed=True)
    assert [n for _, n in plan.prefill] == [300]


def test_append_token_finish_reasons() -> None:
    s = _seq("s", 3, 2, 0)
    s.stop_ids = frozenset({7})
    s.sampling = SamplingParams(max_tokens=2)
    assert s.append_token(4) is None
    assert s.append_token(5) == "length"
    t = _seq("t", 3, 2, 0)
    t.stop_ids = frozenset({7})
    assert t.append_token(7) == "stop"
    assert t.phase is Phase.FINISHED


@pytest.fixture
def pool() -> PagePool:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
    return PagePool(4, layout, torch.float32, torch.device("cpu"))


def test_pool_reuses_freed_pages_first_and_checks(pool: PagePool) -> None:
    assert pool.allocate(3) == [0, 1, 2]
    with pytest.raises(OutOfPagesError, match="needs 2 KV pages but only 1"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.free([1])
    assert pool.allocate(2) == [1, 3]  # the freed (resident) page first, then untouched ones
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([1, 1])
    assert pool.num_free == 0  # a refused free returns nothing
    pool.free([3, 0])
    assert pool.allocate(1) == [3]


def test_pool_page_roundtrip_and_checks(pool: PagePool) -> None:
    (pid,) = pool.allocate(1)
    pool.tensor[pid].copy_(torch.randn(pool.layout.page_shape))
    raw = pool.page_bytes(pid)
    assert len(raw) == pool.page_nbytes == 2 * 2 * 2 * 4 * 4 * 4
    for data in (raw, bytearray(raw), memoryview(raw)):
        assert torch.equal(pool.check_page(0, data), pool.page(pid))
    with pytest.raises(PageLayoutError, match="page 3: 12 bytes"):
        pool.check_page(3, raw[:12])
    strided = memoryview(bytearray(raw * 2))[::2]
    with pytest.raises(PageLayoutError, match="page 0"):
        pool.check_page(0, strided)


def test_plan_policy_over_random_mixes() -> None:
    """For seeded random mixes of prefill and decode sequences: the chunks fit the budget, the
    budget goes to prompts in arrival order (a later prompt gets tokens only when every
    earlier one got all it needs), and every decode sequence is in the batch, or the batch
    is full of sequences that decoded no later than it did (none is starved)."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        seqs = []
        for i in range(rng.randrange(1, 12)):
            n = rng.randrange(2, 200)
            computed = n - 1 if rng.random() < 0.5 else rng.randrange(0, n - 1)
            seqs.append(_seq(f"s{i}", n, computed, i, last=rng.randrange(-1, 5)))
        budget, cap = rng.randrange(1, 300), rng.randrange(1, 6)
        plan = plan_step(seqs, prefill_budget=budget, max_batch=cap)
        budget -= min(len(plan.decode), budget // 2)  # the decode rows' share of the step
        decoding = [s for s in seqs if s.phase is Phase.DECODE]
        prompts = [s for s in seqs if s.phase is Phase.PREFILL]
        planned = {s.request_id: n for s, n in plan.prefill}
        assert sum(planned.values()) <= budget + tail_slack(budget)
        assert all(n >= 1 for _, n in plan.prefill)
        if sum(planned.values()) > budget:  # only by a last prompt taking all it needs
            last = plan.prefill[-1][0]
            assert planned[last.request_id] == last.remaining
        assert [s.request_id for s, _ in plan.prefill] == [
            s.request_id for s in prompts[: len(plan.prefill)]
        ]
        for earlier in prompts[: len(plan.prefill) - 1]:
            assert planned[earlier.request_id] == earlier.remaining
        if sum(planned.values()) < budget:  # budget left over: every prompt got all it needs
            assert len(planned) == len(prompts)
            assert all(planned[s.request_id] == s.remaining for s in prompts)
        decoding = [s for s in seqs if s.phase is Phase.DECODE]
        assert len(plan.decode) == min(cap, len(decoding))
        chosen = {s.request_id for s in plan.decode}
        key = max(((s.last_decode_step, s.arrival) for s in plan.decode), default=None)
        for s in decoding:
            if s.request_id not in chosen:
                assert key is not None and (s.last_decode_step, s.arrival) > key


def test_decode_is_never_starved_by_a_long_prompt() -> None:
    """A prompt far larger than the budget takes it step after step; the running sequences
    decode in every one of those steps."""
    long = _seq("long", 5000, 0, 0)
    running = [_seq(f"d{i}", 10, 9, i + 1) for i in range(3)]
    for _ in range(5):
        plan = plan_step([long, *running], prefill_budget=256, max_batch=8)
        assert [(s.request_id, n) for s, n in plan.prefill] == [("long", 253)]
        assert {s.request_id for s in plan.decode} == {"d0", "d1", "d2"}
        long.num_computed += 253


def test_mixed_budget_applies_only_while_requests_decode() -> None:
    """With a decode batch the prefill gets ``mixed_budget`` tokens (the streams wait for the
    step); alone, a prompt gets the whole ``prefill_budget``, and when the last stream
    leaves, the full budget is back."""
    long, short = _seq("long", 1000, 0, 0), _seq("short", 100, 0, 1)
    running = _seq("d", 10, 9, 2)
    plan = plan_step([long, short, running], prefill_budget=512, max_batch=8, mixed_budget=128)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("long", 127)]  # + 1 decode row
    assert [s.request_id for s in plan.decode] == ["d"]
    plan = plan_step([long, short], prefill_budget=512, max_batch=8, mixed_budget=128)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("long", 512)]
    # a mixed budget larger than the step's budget changes nothing
    plan = plan_step([long, running], prefill_budget=256, max_batch=8, mixed_budget=4096)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("long", 255)]


def test_a_queue_of_prompts_beside_streams_gets_the_queued_budget() -> None:
    """Two or more prompts waiting beside a decode batch: ``queued_budget`` tokens (fewer,
    larger steps for the queue); one prompt alone beside streams: ``mixed_budget``."""
    a, b, c = _seq("a", 257, 0, 0), _seq("b", 257, 0, 1), _seq("c", 257, 0, 2)
    running = _seq("d", 10, 9, 3)
    plan = plan_step([a, b, c, running], 512, 8, mixed_budget=256, queued_budget=512)
    # b's last 2 tokens ride along (tail slack) rather than cost b one more step
    assert [(s.request_id, n) for s, n in plan.prefill] == [("a", 257), ("b", 257)]
    assert [s.request_id for s in plan.decode] == ["d"]
    # without a queued budget (a step-time target), the mixed budget as before, exact
    plan = plan_step([a, b, c, running], 512, 8, mixed_budget=256, timed=True)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("a", 256)]
    # one prompt beside streams keeps the mixed budget
    e = _seq("e", 400, 0, 0)
    plan = plan_step([e, running], 512, 8, mixed_budget=256, queued_budget=512)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("e", 255)]
    # never more than the step's budget (its decode row included)
    plan = plan_step([a, b, running], 300, 8, mixed_budget=256, queued_budget=512)
    assert sum(n for _, n in plan.prefill) == 299


def test_a_lone_prompt_just_over_the_budget_takes_its_tail_in_one_chunk() -> None:
    """513 tokens under a 512 budget: one chunk (no second forward pass for one token);
    past the slack it is split as before; with a stream decoding too, unless the budget was
    sized by a step-time target (then it is exact)."""
    assert tail_slack(512) == 64
    just_over = _seq("p", 513, 0, 0)
    plan = plan_step([just_over], prefill_budget=512, max_batch=8)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("p", 513)]
    at_slack, past = _seq("a", 576, 0, 0), _seq("b", 577, 0, 0)
    assert [n for _, n in plan_step([at_slack], 512, 8).prefill] == [576]
    assert [n for _, n in plan_step([past], 512, 8).prefill] == [512]
    # the tail of a long prompt: 2000 = 3 x 512 + 464 (under the budget anyway)
    long = _seq("l", 1560, 1024, 0)
    assert [n for _, n in plan_step([long], 512, 8).prefill] == [536]
    running = _seq("d", 10, 9, 1)
    plan = plan_step([just_over, running], prefill_budget=512, max_batch=8)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("p", 513)]
    plan = plan_step([just_over, running], 512, 8, mixed_budget=512, timed=True)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("p", 512)]
    # the 8-client row: four 257-token prompts under the queue budget beside streams
    queue = [_seq(f"q{i}", 257, 0, 2 + i) for i in range(4)]
    plan = plan_step([running, *queue], 1024, 8, mixed_budget=512, queued_budget=1024)
    assert [n for _, n in plan.prefill] == [257, 257, 257, 257]
    # a later prompt gets no tokens once the budget is spent by the first one's tail
    other = _seq("o", 50, 0, 1)
    plan = plan_step([just_over, other], prefill_budget=512, max_batch=8)
    assert [(s.request_id, n) for s, n in plan.prefill] == [("p", 513)]
