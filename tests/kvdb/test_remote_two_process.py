"""Two-process smoke test of the remote read path: a spawned holder process (shards, transfer
server, BlockService), this process reading through RemoteClient (bench_kvdb --remote, tiny)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.tools.bench.kvdb import main as bench_main
from kvflow.tools.bench.kvdb_remote import run_remote, summary


def test_remote_reads_across_processes_match_raw_bytes() -> None:
    report = run_remote([64 << 10, 1 << 20], working_set_mib=4, repeat=1, seed=3)
    # run_remote raises if a block missed or the remote bytes differ from the raw stream's
    assert [(r["size"], r["count"]) for r in report["results"]] == [(64 << 10, 64), (1 << 20, 4)]
    assert all(r["remote_gbps"] > 0 and r["raw_gbps"] > 0 for r in report["results"])
    assert summary(report).startswith("kvdb remote batch_get_into, 2 processes")


def test_bench_kvdb_remote_flag_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "remote.json"
    code = bench_main(
        [
            "--remote",
            "--sizes",
            "4MiB",
            "--working-set-mib",
            "8",
            "--repeat",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert (
        report["benchmark"] == "kvdb_remote_batch_get_into" and report["results"][0]["count"] == 4
    )
    assert capsys.readouterr().out.count("\n") == 1
