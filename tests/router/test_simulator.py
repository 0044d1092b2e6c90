"""The trace simulator on 300 requests of the Mooncake synthetic trace (records 3600-3899)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvflow.router import SimulationConfig, SimulationReport, read_trace, simulate

SLICE = Path(__file__).parent / "data" / "mooncake_slice_3600_3900.jsonl"


@pytest.fixture(scope="module")
def records():
    return read_trace(SLICE)


def run(records, policy: str, seed: int = 0, **router: object) -> SimulationReport:
    base = SimulationConfig(num_prefill=8, num_decode=4)
    config = replace(base, router=replace(base.router, policy=policy, seed=seed, **router))
    return simulate(config, records)


def test_deterministic(records):
    assert run(records, "random").to_dict() == run(records, "random").to_dict()
    assert run(records, "cache-aware").to_dict() == run(records, "cache-aware").to_dict()
    other_seed = run(records, "random", seed=1)
    assert other_seed.per_instance_requests != run(records, "random").per_instance_requests


def test_cache_aware_beats_the_baselines_on_mean_ttft(records):
    reports = {p: run(records, p) for p in ("cache-aware", "local-cache-aware", "random")}
    cache_aware = reports["cache-aware"]
    assert cache_aware.served == 300
    assert cache_aware.ttft_mean_s < reports["random"].ttft_mean_s / 2
    # §4.2: balancing (pulling from an overloaded holder) improves on local cache-awareness.
    assert cache_aware.ttft_mean_s < reports["local-cache-aware"].ttft_mean_s
    assert cache_aware.cache_hit_ratio > reports["random"].cache_hit_ratio
    assert cache_aware.pulls > 0 and cache_aware.pulled_blocks >= cache_aware.pulls
    assert reports["local-cache-aware"].pulls == 0
    assert cache_aware.ttft_p50_s <= cache_aware.ttft_p90_s <= cache_aware.ttft_p99_s


def test_slo_rejections_are_counted(records):
    report = run(records, "round-robin", ttft_slo_s=5.0)
    assert report.rejected > 0
    assert report.rejected_by_reason == {"ttft_slo": report.rejected}
    assert report.served + report.rejected == report.num_requests == 300
    assert report.rejection_rate == pytest.approx(report.rejected / 300)


def test_empty_trace_and_config_validation():
    report = simulate(SimulationConfig(), [])
    assert (report.num_requests, report.ttft_mean_s, report.requests_per_s) == (0, 0.0, 0.0)
    with pytest.raises(ValueError, match="num_prefill"):
        SimulationConfig(num_prefill=0)
    with pytest.raises(ValueError, match="time_scale"):
        SimulationConfig(time_scale=0.0)


def test_a_run_restores_the_garbage_collector(records):
    import gc

    before, frozen = gc.get_threshold(), gc.get_freeze_count()  # another test may have frozen
    simulate(SimulationConfig(num_prefill=2, num_decode=2), records[:50])
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # restored when a run stops half-way too
        simulate(SimulationConfig(num_prefill=2, num_decode=2), records, stop)
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen


@pytest.mark.parametrize(
    ("prefill", "decode", "router"),
    [(8, 4, {}), (16, 24, {}), (8, 12, {"tbt_slo_s": 0.026, "ttft_slo_s": 4.0})],
)
def test_fast_run_equals_the_reference_run(records, prefill, decode, router):
    """Every report field and every request's outcome of the fast run (arrays, decode groups)
    equal those of the per-instance reference conductor's run."""
    base = SimulationConfig(num_prefill=prefill, num_decode=decode)
    config = replace(base, router=replace(base.router, **router))
    fast, reference = simulate(config, records), simulate(config, records, reference=True)
    assert fast == reference
    assert fast.outcomes == reference.outcomes
    assert len({o.decode_id for o in fast.outcomes if o.decode_id}) > decode // 2
    if router:  # both SLOs reject some requests, through the grouped choice's TBT too
        assert set(fast.rejected_by_reason) == {"ttft_slo", "tbt_slo"}
