"""The mixed step's prompt budget follows a target step time (engine/step_budget.py).

No test here reads a real clock: step times come from a cost model (seconds = base +
per_token * prompt tokens + per_row * decode rows), injected as the engine's clock, which
the model's forward passes advance."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.stages.engine.step_budget import MIN_FLOOR, StepBudget
from tests.stages.engine.conftest import open_engine

PROMPT = 500


def cost(prompt: int, rows: int) -> float:
    """A machine where a decode step of 4 rows takes 60 ms and a prompt token 2 ms."""
    return (0.05 + 0.0025 * rows if rows else 0.01) + 0.002 * prompt


def test_budget_converges_to_the_target_from_measured_steps() -> None:
    budget = StepBudget(target_s=0.15, ceiling=256)
    assert budget.tokens() == MIN_FLOOR  # nothing measured yet: the least
    for _ in range(3):
        budget.observe(0, 4, cost(0, 4))  # the streams decode alone
    sizes = []
    for _ in range(12):
        n = budget.tokens()
        sizes.append(n)
        budget.observe(n, 4, cost(n, 4))
    # (0.15 - 0.06) / 0.002 = 45 tokens: one measured mixed step is enough
    assert sizes[0] == MIN_FLOOR and sizes[1:] == [45] * 11
    assert cost(sizes[-1], 4) == pytest.approx(0.15, abs=0.002)


def test_budget_converges_without_a_decode_only_step() -> None:
    """A prompt joins streams that never stepped alone: each measure of a token's cost
    includes the decode's, and the budget still settles at a step of the target."""
    budget = StepBudget(target_s=0.15, ceiling=256)
    for _ in range(40):
        n = budget.tokens()
        budget.observe(n, 4, cost(n, 4))
    assert abs(cost(budget.tokens(), 4) - 0.15) < 0.004


def test_budget_stays_within_its_bounds_and_tracks_a_slower_machine() -> None:
    budget = StepBudget(target_s=0.15, ceiling=64)
    budget.observe(0, 4, 0.01)
    budget.observe(32, 4, 0.01 + 32 * 1e-5)  # very cheap tokens: the ceiling
    assert budget.tokens() == 64
    for _ in range(30):  # the decode alone takes longer than the target: the floor
        budget.observe(0, 4, 0.3)
        budget.observe(budget.tokens(), 4, 0.3 + 0.002 * budget.tokens())
    assert budget.tokens() == MIN_FLOOR
    assert StepBudget(0.1, ceiling=8).tokens() == 8  # a floor above the ceiling: the ceiling


def test_budget_is_steady_under_noise() -> None:
    rng = random.Random(7)
    budget = StepBudget(target_s=0.15, ceiling=256)
    sizes = []
    for _ in range(200):
        n = budget.tokens()
        sizes.append(n)
        budget.observe(n, 4, cost(n, 4) * rng.uniform(0.8, 1.2))
    settled = sizes[20:]
    assert min(settled) >= 30 and max(settled) <= 60  # 45 +- the noise


def test_bad_targets_are_refused() -> None:
    with pytest.raises(ValueError, match="target step time"):
        StepBudget(0.0, ceiling=64)
    with pytest.raises(ValueError, match="tbt_target_ms"):
        EngineConfig(tbt_target_ms=-5)
    with pytest.raises(ValueError, match="tbt_target_ms"):
        EngineConfig(tbt_target_ms=float("nan"))


class CostClock:
    """The engine's clock: time passes only in the model's forward passes, by ``cost``."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        runner = engine._runner
        for name in ("prefill", "decode", "mixed"):
            original = getattr(runner, name)

            def timed(*args: Any, _f: Any = original, _n: str = name, **kw: Any) -> Any:
                self.now += self._cost(_n, args)
                return _f(*args, **kw)

            monkeypatch.setattr(runner, name, timed)

    @staticmethod
    def _cost(name: str, args: tuple[Any, ...]) -> float:
        if name == "prefill":
            return cost(args[1], 0)
        if name == "decode":
            return cost(0, len(args[0]))
        chunks, decode = args
        return cost(sum(n for _, n in chunks), len(decode))

    def __call__(self) -> float:
        return self.now


def _long_prompt_beside_streams(engine: Engine) -> tuple[list[int], dict[str, list[int]]]:
    """Four streams decode; a long prompt joins them. Returns the prompt tokens of
    each step that also decoded, and every request's tokens."""
    out: dict[str, list[int]] = {}
    chunks: list[int] = []

    def step() -> None:
        seqs = dict(engine._seqs)
        before = {rid: s.num_computed for rid, s in seqs.items()}
        decoded = False
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            decoded = decoded or (o.request_id != "long" and bool(o.new_token_ids))
        if "long" in seqs and decoded and before["long"] < PROMPT:
            chunks.append(seqs["long"].num_computed - before["long"])

    for i in range(4):
        engine.add_request(f"s{i}", [3 + i, 9, 27, 81], SamplingParams(max_tokens=60))
    for _ in range(4):
        step()
    engine.add_request(
        "long", [(5 * i) % 200 + 3 for i in range(PROMPT)], SamplingParams(max_tokens=2)
    )
    while engine.has_unfinished():
        step()
    return chunks, out


def test_engine_sizes_mixed_steps_to_the_target(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budgeted = open_engine(
        llama_dir, prefill_chunk=256, mixed_chunk=128, tbt_target_ms=150.0, num_pages=128
    )
    assert budgeted.step_budget is not None and budgeted.step_budget.ceiling == 128
    budgeted.clock = CostClock(budgeted, monkeypatch)
    chunks, tokens = _long_prompt_beside_streams(budgeted)
    # The streams' own prompts measured a token (dearer in a small chunk): fewer tokens
    # first, rising towards 45 a step: (0.15 s - a decode step of 4 rows, 0.06 s) / 0.002 s,
    # never a step over the target.
    assert chunks[0] < 45 and chunks[:-1] == sorted(chunks[:-1])
    assert all(43 <= n <= 45 for n in chunks[-4:-1]) and sum(chunks) == PROMPT
    assert max(cost(n, 4) for n in chunks) <= 0.15 + 1e-9
    fixed_chunks, fixed_tokens = _long_prompt_beside_streams(
        open_engine(llama_dir, prefill_chunk=256, mixed_chunk=128, num_pages=128)
    )
    # no target: the fixed mixed chunk, of which the 4 streams' decode rows take 4
    assert fixed_chunks == [124] * 3 + [PROMPT - 3 * 124]  # the last within the tail slack
    assert tokens == fixed_tokens  # the budget moves work between steps, never changes it
