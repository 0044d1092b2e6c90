"""The metadata benchmark runs end to end on a tiny input and counts one entry per batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.tools.bench import metadata as bench_metadata


def test_bench_runs_and_writes_json(tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "bench.json"
    code = bench_metadata.main(
        ["--blocks", "200", "--batch", "50", "--replicas", "1", "--json", str(out)]
    )
    assert code == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["batches"] == 4
    # index 1: pysyncobj's initial no-op, index 2: the new leader's no-op, then one per batch
    assert result["commit_idx"] == 2 + 4
    assert result["blocks_per_s"] > 0
    printed = capsys.readouterr().out.strip().splitlines()  # type: ignore[attr-defined]
    assert len(printed) == 1 and printed[0].startswith("bench_metadata: 200 blocks")


@pytest.mark.slow
@pytest.mark.cluster
def test_bench_processes_mode_measures_throughput_and_reelection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--processes", "--blocks", "2000", "--batch", "500", "--kills", "1"]
    assert bench_metadata.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())["processes"]
    assert result["blocks"] == 2000 and result["replicas"] == 3
    assert result["blocks_per_s"] > 0
    (reelection,) = result["reelection_s"]
    assert 0 < reelection < 30
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("bench_metadata: 3 replica processes")
