"""The simulator's engines alone: decode memory and batching, prefill chunking and batching."""

from __future__ import annotations

import pytest

from kvflow.router import DecodeTimeModel, PrefillTimeModel
from kvflow.router.sim_decode import DecodeInstance
from kvflow.router.sim_prefill import PrefillInstance, PrefillJob

STEP = DecodeTimeModel((0.01, 0.0, 0.0), "t")  # 10 ms per step whatever the batch
PREFILL = PrefillTimeModel((0.5, 1e-3, 1e-7, 1e-5), "t")


def test_decode_waits_for_memory_and_never_exceeds_it():
    inst = DecodeInstance("d", STEP, capacity_tokens=300)
    inst.arrive("a", 100, 100, 0.0)  # needs 200
    inst.arrive("b", 50, 50, 0.0)  # needs 100: fits (300)
    inst.arrive("c", 10, 10, 0.0)  # needs 20: waits
    assert (inst.batch_size, inst.waiting, inst.used_tokens) == (2, 1, 300)
    done = inst.advance(0.5)  # b leaves after 50 steps = 0.5 s; c joins then
    assert [d[0] for d in done] == ["b"] and done[0][2] == pytest.approx(0.5)
    assert inst.take_joined() == [("a", 0.0), ("b", 0.0), ("c", pytest.approx(0.5))]
    finished = inst.advance(10.0)
    assert sorted(d[0] for d in finished) == ["a", "c"]
    assert dict((d[0], d[2]) for d in finished) == {
        "a": pytest.approx(1.0),
        "c": pytest.approx(0.6),
    }
    assert inst.peak_tokens == 300 and inst.used_tokens == 0
    with pytest.raises(ValueError, match="decode capacity"):
        inst.arrive("huge", 300, 1, 11.0)


def test_decode_step_time_follows_the_batch():
    model = DecodeTimeModel((0.0, 0.01, 0.0), "t")  # 10 ms per sequence per step
    inst = DecodeInstance("d", model, capacity_tokens=None)
    inst.arrive("a", 1, 10, 0.0)  # alone: 10 ms per token
    assert inst.next_departure() == pytest.approx(0.1)
    inst.arrive("b", 1, 10, 0.05)  # a has 5 tokens left, now at 20 ms per token
    assert inst.next_departure() == pytest.approx(0.15)


def _drive(inst: PrefillInstance, until: float = 100.0) -> None:
    t: float | None = 0.0
    while t is not None and t <= until:
        t = inst.poke(t)


def test_unchunked_single_prefill_costs_exactly_the_model():
    done: dict[str, float] = {}
    inst = PrefillInstance("p", PREFILL, 1 << 30, 1 << 30, lambda *_: None,
                           lambda j, at: done.__setitem__(j.request_id, at))  # fmt: skip
    inst.submit(PrefillJob("a", 4000, 1000, 0.0))
    _drive(inst)
    assert done["a"] == pytest.approx(PREFILL.predict(4000, 1000))


def test_chunks_add_up_to_the_model_plus_fixed_costs_and_wait_for_pulls():
    done: dict[str, float] = {}
    inst = PrefillInstance("p", PREFILL, 1000, 1500, lambda *_: None,
                           lambda j, at: done.__setitem__(j.request_id, at))  # fmt: skip
    inst.submit(PrefillJob("a", 4000, 1000, 0.0))  # 3 chunks of 1000
    inst.submit(PrefillJob("b", 500, 0, 7.0))  # its pull lands at 7.0 s, after a
    _drive(inst)
    assert inst.served == 2
    alone = PREFILL.predict(4000, 1000) + 2 * 0.5  # two extra steps pay c0 again
    assert done["a"] == pytest.approx(alone)  # b is not ready while a runs
    assert done["b"] == pytest.approx(7.0 + PREFILL.predict(500, 0))


def test_cost_model_from_kvflow_profile_output(tmp_path):
    from kvflow.router import Profile
    from kvflow.router.sim_presets import make_preset, preset_from_profile

    Profile(PrefillTimeModel((1, 2, 3, 4), "m"), DecodeTimeModel((5, 6, 7), "m")).save(tmp_path)
    preset = preset_from_profile(tmp_path / "kvflow_profile.json", 1000, 50_000)
    assert preset.prefill.coefficients == (1, 2, 3, 4) and preset.decode_capacity_tokens == 50_000
    assert "kvflow profile" in preset.source
    with pytest.raises(ValueError, match="kvflow profile"):
        preset_from_profile(tmp_path / "nothing", 1000, 50_000)
    with pytest.raises(ValueError, match="unknown cost preset"):
        make_preset("gpt-9")
