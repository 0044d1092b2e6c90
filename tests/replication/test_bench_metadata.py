"""The metadata benchmark runs end to end on a tiny input and counts one entry per batch."""

from __future__ import annotations

import json
from pathlib import Path

from kvflow.tools import bench_metadata


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
