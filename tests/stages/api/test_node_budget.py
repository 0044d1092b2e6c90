"""The router's node-call budget: a call's deadline is the request's time left (not the
conductor's prediction), and the hang watchdog's probe timeout follows the node's recent
answers within its bounds."""

from __future__ import annotations

import pytest

from kvflow.stages.api.node_guard import NodeCallBudget
from kvflow.stages.engine import SamplingParams
from kvflow.stages.state import GenerateState


def _state(submitted_at: float) -> GenerateState:
    return GenerateState(
        tenant="t",
        max_tokens=8,
        sampling=SamplingParams(max_tokens=8),
        prompt_ids=list(range(4000)),
        submitted_at=submitted_at,
    )


def test_a_call_gets_the_request_time_left() -> None:
    b = NodeCallBudget(base_s=5.0, request_s=600.0)
    state = _state(submitted_at=100.0)
    assert b.deadline(state) == 700.0
    assert b.call_s(state, now=100.0) == 600.0
    assert b.call_s(state, now=400.0) == 300.0
    assert b.call_s(state, now=699.0) == 5.0  # never less than base_s
    assert b.call_s(state, now=900.0) == 5.0


def test_the_probe_timeout_follows_recent_answers_within_bounds() -> None:
    b = NodeCallBudget(probe_timeout_s=0.75, probe_slack=4.0, probe_timeout_max_s=10.0)
    assert b.probe_s([]) == 0.75  # nothing known: the floor (a paused idle node: ~1 s)
    assert b.probe_s([0.01, 0.02]) == 0.75
    assert b.probe_s([0.1, 0.5, 0.2]) == 2.0  # a loaded node: 4 x its slowest answer
    assert b.probe_s([3.0]) == 10.0  # the ceiling


@pytest.mark.parametrize(
    "fields",
    [{"request_s": 0}, {"probe_slack": float("nan")}, {"probe_timeout_max_s": 0.5}],
)
def test_bad_budgets_are_refused_naming_the_field(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        NodeCallBudget(**fields)
