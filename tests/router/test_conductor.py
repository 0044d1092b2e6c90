"""The conductor's Algorithm 1 on two prefill instances with hand-checkable numbers.

Cost model (conftest): prefill = 1 ms per new token, a block is 10 tokens and moves in 1 ms,
decode TBT = 10 ms + 1 ms per sequence, balancing threshold 2.0.
"""

from __future__ import annotations

import re

import pytest

from kvflow.router import (
    InstanceKind,
    InstanceState,
    PullPlan,
    Rejection,
    RejectReason,
    RouteDecision,
    RouteRequest,
    TransferEstimator,
    find_state,
)
from kvflow.router.conductor import Conductor
from tests.router.conftest import (
    LINEAR_PREFILL,
    SIMPLE_DECODE,
    keys,
    load,
    make_conductor,
)

PROMPT = RouteRequest("req-1", keys(10), 100)


def decided(result: RouteDecision | Rejection) -> RouteDecision:
    assert isinstance(result, RouteDecision), result
    return result


def test_repeat_goes_to_the_holder_of_the_prefix(index, prefill, decode):
    index.insert("prefill-1", keys(10))
    d = decided(make_conductor(index).route(PROMPT, prefill, decode))
    assert d.prefill_id == "prefill-1"
    assert d.pull is None
    assert (d.local_prefix_blocks, d.reused_blocks, d.reused_tokens) == (10, 10, 100)
    assert d.t_prefill == pytest.approx(0.0)
    assert [c.local_prefix_blocks for c in d.candidates] == [0, 10]


def test_overloaded_holder_makes_another_instance_pull(index, prefill, decode):
    index.insert("prefill-1", keys(10))
    load(prefill, [0.0, 1.0])
    d = decided(make_conductor(index).route(PROMPT, prefill, decode))
    assert d.prefill_id == "prefill-0"
    assert d.pull == PullPlan(from_instance="prefill-1", start_block=0, num_blocks=10)
    assert d.reused_blocks == 10
    assert d.t_transfer == pytest.approx(0.010)
    assert d.t_queue == pytest.approx(0.0)
    assert d.ttft_s == pytest.approx(0.010)


def test_local_cache_aware_never_pulls(index, prefill, decode):
    index.insert("prefill-1", keys(10))
    load(prefill, [0.0, 1.0])
    d = decided(make_conductor(index, "local-cache-aware").route(PROMPT, prefill, decode))
    assert d.prefill_id == "prefill-0"
    assert d.pull is None
    assert d.reused_blocks == 0
    assert d.ttft_s == pytest.approx(0.100)


@pytest.mark.parametrize(
    ("holder_blocks", "expected_pull"),
    [
        (8, None),  # 8 == 2.0 * 4: not above the threshold, prefill-0 recomputes
        (9, PullPlan("prefill-1", 4, 5)),  # 9 > 8: pull blocks 4..8
    ],
)
def test_balancing_threshold_boundary(index, prefill, decode, holder_blocks, expected_pull):
    index.insert("prefill-0", keys(4))
    index.insert("prefill-1", keys(holder_blocks))
    load(prefill, [0.0, 1.0])
    d = decided(make_conductor(index).route(PROMPT, prefill, decode))
    assert d.prefill_id == "prefill-0"
    assert d.pull == expected_pull
    if expected_pull is None:
        assert d.reused_blocks == 4
        assert d.ttft_s == pytest.approx(0.060)
    else:
        assert d.reused_blocks == holder_blocks
        assert d.ttft_s == pytest.approx(0.005 + 0.010)


def test_pull_skipped_when_transfer_costs_more_than_recompute(index, prefill, decode):
    index.insert("prefill-1", keys(10))
    load(prefill, [0.0, 1.0])
    slow_link = TransferEstimator(1e3, 0.0)  # 1 s per block
    conductor = Conductor(
        make_conductor(index).config, index, LINEAR_PREFILL, SIMPLE_DECODE, slow_link
    )
    d = decided(conductor.route(PROMPT, prefill, decode))
    assert (d.prefill_id, d.pull, d.reused_blocks) == ("prefill-0", None, 0)
    assert d.candidates[0].balanced == d.candidates[0].local


def test_decode_instance_with_lowest_tbt(index, prefill, decode):
    decode[0].add_decode("other", 500)
    d = decided(make_conductor(index).route(PROMPT, prefill, decode))
    assert d.decode_id == "decode-1"
    assert d.tbt_s == pytest.approx(0.011)
    assert [c.tbt_s for c in d.decode_candidates] == pytest.approx([0.012, 0.011])


def test_ttft_slo_rejection_gives_predictions(index, prefill, decode):
    load(prefill, [0.5, 0.7])
    result = make_conductor(index, ttft_slo_s=0.3).route(PROMPT, prefill, decode)
    assert isinstance(result, Rejection)
    assert result.reason is RejectReason.TTFT_SLO
    assert result.prefill_id == "prefill-0"
    assert result.ttft_s == pytest.approx(0.6)
    text = result.message()
    assert "ttft_slo" in text
    assert "TTFT 0.600s on prefill-0 (queue 0.500s + prefill 0.100s + transfer 0.000s)" in text
    assert "SLO 0.300s" in text


def test_tbt_slo_met_exactly_then_rejected(index, prefill, decode):
    decode[0].add_decode("a", 10)
    conductor = make_conductor(index, tbt_slo_s=0.011)
    ok = decided(conductor.route(PROMPT, prefill, decode))
    assert ok.decode_id == "decode-1"  # 0.011 is not above the SLO
    decode[1].add_decode("b", 10)
    result = conductor.route(PROMPT, prefill, decode)
    assert isinstance(result, Rejection)
    assert result.reason is RejectReason.TBT_SLO
    assert result.tbt_s == pytest.approx(0.012)
    assert re.search(r"TBT 0.0120s on decode-[01] vs SLO 0.011s", result.message())


def test_no_healthy_instance(index, prefill, decode):
    for state in prefill:
        state.set_healthy(False)
    result = make_conductor(index).route(PROMPT, prefill, decode)
    assert isinstance(result, Rejection)
    assert result.reason is RejectReason.NO_INSTANCE
    assert result.ttft_s is None
    assert "no healthy prefill instance" in result.message()


def test_unhealthy_holder_is_neither_chosen_nor_pulled_from(index, prefill, decode):
    index.insert("prefill-1", keys(10))
    prefill[1].set_healthy(False)
    d = decided(make_conductor(index).route(PROMPT, prefill, decode))
    assert (d.prefill_id, d.pull, d.reused_blocks) == ("prefill-0", None, 0)
    assert [c.instance_id for c in d.candidates] == ["prefill-0"]


def test_route_is_pure_and_commit_applies(index, prefill, decode):
    index.insert("prefill-1", keys(10))
    load(prefill, [0.0, 1.0])
    conductor = make_conductor(index)
    first = decided(conductor.route(PROMPT, prefill, decode))
    second = decided(conductor.route(PROMPT, prefill, decode))
    assert first == second
    assert [s.queued_requests for s in prefill] == [0, 1]
    assert index.match("prefill-0", PROMPT.block_keys) == 0
    chosen_decode = find_state(decode, first.decode_id)  # idle decode instances tie
    conductor.commit(first, prefill[0], chosen_decode)
    assert prefill[0].queued_seconds() == pytest.approx(first.t_transfer + first.t_prefill)
    assert (chosen_decode.decode_batch_size, chosen_decode.decode_context_tokens) == (1, 100)
    with pytest.raises(ValueError, match="prefill_state"):
        conductor.commit(first, prefill[1], chosen_decode)


def test_running_work_counts_only_its_remainder(index, prefill, decode):
    prefill[0].enqueue("running", 1.0)
    prefill[0].start("running", now=10.0)
    prefill[1].enqueue("waiting", 0.5)
    d = decided(make_conductor(index).route(PROMPT, prefill, decode, now=10.8))
    assert d.prefill_id == "prefill-0"
    assert d.t_queue == pytest.approx(0.2)


def test_bad_input_is_refused(index, prefill, decode):
    conductor = make_conductor(index)
    with pytest.raises(ValueError, match="block_keys has 11 keys"):
        conductor.route(RouteRequest("r", keys(11), 100), prefill, decode)
    with pytest.raises(ValueError, match="expected prefill"):
        conductor.route(PROMPT, decode, decode)
    with pytest.raises(ValueError, match="prompt_len"):
        RouteRequest("r", keys(1), 0)
    with pytest.raises(ValueError, match=r"block_keys\[1\]"):
        RouteRequest("r", (b"a", b""), 10)


def test_trailing_partial_block_is_accepted(index, prefill, decode):
    index.insert("prefill-0", keys(11))
    d = decided(make_conductor(index).route(RouteRequest("r", keys(11), 105), prefill, decode))
    assert d.reused_tokens == 105  # capped at the prompt


def test_instance_kind_checked_on_states():
    with pytest.raises(ValueError):
        InstanceState("x", "mixed")
    state = InstanceState("x", InstanceKind.DECODE)
    assert state.kind is InstanceKind.DECODE


def test_predict_prefill_s_is_the_prefill_models_prediction() -> None:
    """The warm-up report's "prefill time saved" reads this (a merge once lost the model)."""
    from kvflow.router import (
        Conductor,
        DecodeTimeModel,
        LocalPrefixIndex,
        PrefillTimeModel,
        RouterConfig,
        TransferEstimator,
    )

    model = PrefillTimeModel.default()
    c = Conductor(
        RouterConfig(block_size=16, block_nbytes=1024),
        LocalPrefixIndex(),
        model,
        DecodeTimeModel.default(),
        TransferEstimator(1e9),
    )
    assert c.predict_prefill_s(2048, 0) == model.predict(2048, 0)
    assert c.predict_prefill_s(2048, 4096) == model.predict(2048, 2048)
    assert c.predict_prefill_s(2048, 1024) < c.predict_prefill_s(2048, 0)
