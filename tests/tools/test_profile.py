"""`kvflow profile` fits the conductor's models from real engine timings; serve picks them up."""

from __future__ import annotations

import json

import pytest

from kvflow.router import load_profile
from kvflow.stages.engine import Engine, EngineConfig, write_demo_model
from kvflow.tools.cli import main


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny"
    write_demo_model(path, preset="tiny", seed=0)
    return path


def test_profile_writes_a_fitted_profile_for_this_model(tiny, capsys):
    assert main(["profile", "--model", str(tiny), "--quick", "--block-size", "16"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["profile"].endswith("kvflow_profile.json")
    engine = Engine.open(tiny, EngineConfig(block_size=16))
    profile = load_profile(tiny, model_id=engine.model_fingerprint)
    assert not profile.is_default
    assert profile.prefill.model_id == engine.model_fingerprint
    # Fitted to measured timings (never the default coefficients); predictions are times.
    assert profile.prefill.coefficients != type(profile.prefill).default().coefficients
    assert all(v >= 0 for v in summary["predicted_cold_prefill_s"].values())


def test_profile_of_a_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["profile", "--model", str(tmp_path / "nope"), "--quick"]) == 2
    assert "does not exist" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_e2e_quick_runs(tmp_path, capsys):
    from kvflow.tools.bench import e2e as bench_e2e

    out = tmp_path / "e2e.json"
    assert bench_e2e.main(["--quick", "--policies", "cache-aware,random", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ttft"][0]["cached_tokens"] > 0
    assert {p["policy"] for p in data["policies"]} == {"cache-aware", "random"}
