"""bench_restart end to end: every role of a cluster SIGKILLed and restarted comes back to
serving, and the numbers say how long that took."""

from __future__ import annotations

import json

import pytest

from kvflow.tools.bench import restart as bench_restart


@pytest.mark.slow
@pytest.mark.cluster
def test_every_role_comes_back_to_serving(tmp_path, capsys):
    out = tmp_path / "restart.json"
    # a generous target: this checks that every role comes back and is measured, not the speed
    # of a loaded test machine (BENCHMARKS.md has the numbers against the 5 s target)
    code = bench_restart.main(["--rounds", "1", "--target-s", "60", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert [r["role"] for r in data["rounds"]] == list(bench_restart.ROLES)
    assert all(0 < r["restart_to_serving_s"] < 60 for r in data["rounds"])
    nodes = [r for r in data["rounds"] if r["role"] in ("prefill-0", "decode-0")]
    assert all(r["seen_down_s"] > 0 for r in nodes)
    assert "met by every role" in capsys.readouterr().out


def test_a_role_over_the_target_is_named():
    rounds = [{"role": "router-0", "restart_to_serving_s": s} for s in (1.0, 9.0, 2.0)] + [
        {"role": "decode-0", "restart_to_serving_s": s} for s in (6.0, 7.0, 1.0)
    ]
    medians = bench_restart.medians_by_role(rounds)
    assert medians == {"router-0": 2.0, "decode-0": 6.0}
    assert bench_restart.missed(medians, 5.0) == ["decode-0"]
    assert bench_restart.missed(medians, 6.0) == []


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_restart.main(["--rounds", "0"])
