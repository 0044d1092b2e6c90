"""bench_failover end to end: a supervised cluster, one process of each kind SIGKILLed in turn
(and both decode nodes at once), every request still answered, every answer right."""

from __future__ import annotations

import json

import pytest

from kvflow.tools.bench import failover as bench_failover

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def test_every_kill_is_survived(tmp_path, capsys):
    out = tmp_path / "failover.json"
    assert bench_failover.main(["--requests", "2", "--max-tokens", "300", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["failed_or_wrong"] == 0
    phases = {p["victim"]: p for p in data["phases"]}
    assert list(phases) == list(bench_failover.PHASES)
    assert phases["router-0"]["long_answer_client_failovers"] == 1
    assert all(p["long_answer_ok"] and p["short_failed"] == 0 for p in phases.values())
    assert "0 failed or wrong of 15 requests" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_failover.main(["--requests", "0"])
