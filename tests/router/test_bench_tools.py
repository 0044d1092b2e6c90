"""The router and simulator benchmarks run end to end on tiny inputs and write their JSON."""

from __future__ import annotations

import json
from pathlib import Path

from kvflow.tools.bench import router as bench_router
from kvflow.tools.bench import simulator as bench_simulator

SLICE = Path(__file__).parent / "data" / "mooncake_slice_3600_3900.jsonl"


def test_simulator_bench_compares_fast_and_reference(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--trace", str(SLICE), "--requests", "120", "--sizes", "4+2,8+4", "--repeat", "1"]
    assert bench_simulator.main([*argv, "--json", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("bench_simulator: 120 requests") and "reference" in line
    doc = json.loads(out.read_text())
    assert [(r["prefill"], r["decode"]) for r in doc["results"]] == [(4, 2), (8, 4)]
    for result in doc["results"]:
        for path in ("fast", "reference"):
            assert result[path]["best_req_per_s"] > 0 and len(result[path]["wall_s"]) == 1
    assert len(doc["loadavg_before"]) == 3


def test_router_bench_times_both_conductors(tmp_path, capsys):
    out = tmp_path / "router.json"
    argv = ["--instances", "4", "--blocks", "256", "--chain", "8", "--decisions", "60"]
    assert bench_router.main([*argv, "--reference", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("bench_router: local@4")
    doc = json.loads(out.read_text())
    names = [r["index"] for r in doc["results"]]
    assert names == ["local", "metadata", "local-reference", "metadata-reference"]
    assert all(r["p50_ms"] <= r["p99_ms"] for r in doc["results"])
