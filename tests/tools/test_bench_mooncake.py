"""bench_mooncake on tiny sizes, kvflow alone (Mooncake is never a test dependency): every
column it reports for kvflow is there, the reads were checked byte for byte, and the summary
says Mooncake was skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.tools.bench import mooncake as bench_mooncake


def test_bench_mooncake_tiny_without_mooncake(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--skip-mooncake", "--sizes", "4KiB,64KiB", "--working-set-mib", "0.25"]
    assert bench_mooncake.main([*argv, "--repeat", "1", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_mooncake: local batch_get_into: 4KiB")
    assert "mooncake skipped" in lines[0]
    report = json.loads(out.read_text())
    assert report["mooncake_skipped"] == "--skip-mooncake"
    assert [r["size"] for r in report["local"]] == [4096, 65536]
    assert [r["count"] for r in report["remote"]] == [64, 4]
    for row in report["local"]:
        assert set(row["get"]) == {"memcpy", "kvflow"} and row["get"]["kvflow"]["gbps"] > 0
        assert set(row["put"]) == {"kvflow"} and row["ratios"]["kvflow/memcpy"] > 0
    for row in report["remote"]:  # the same-host reader and one over tcp, both checked
        assert set(row["get"]) == {"kvflow", "kvflow-tcp"}
        assert all(len(got["runs"]) == 1 for got in row["get"].values())


def test_sizes_and_bad_arguments() -> None:
    assert bench_mooncake.parse_size("64KiB") == 65536
    assert bench_mooncake.parse_size("4MiB") == 4 << 20 and bench_mooncake.label(4 << 20) == "4MiB"
    with pytest.raises(SystemExit):
        bench_mooncake.main(["--repeat", "0", "--skip-mooncake"])
