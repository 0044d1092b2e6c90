"""`kvflow warmup` against a real embedded server: dry run, submit with --json, status, list,
report, cancel of a finished job, and an unknown job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvflow.tools.cli import main


def test_cli_submit_status_list_report(
    tiny_model: Path, make_warm: Any, tmp_path: Path, capsys: Any
) -> None:
    w = make_warm(tiny_model)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"prompt": "' + "kv cache " * 20 + '"}\n{bad\n')
    (corpus / "b.txt").write_text("a document about blocks " * 5)
    base = ["warmup", "--server", w.server.address, "--json"]

    assert main([*base, "submit", str(corpus), "--dry-run"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["estimate"]["items_ok"] == 2 and dry["estimate"]["blocks_to_compute"] > 0
    assert dry["corpus_errors"] == [
        f"{corpus}/a.jsonl:2: not JSON: Expecting property name enclosed in double quotes "
        "(column 2)"
    ]

    assert main([*base, "submit", str(corpus)]) == 0
    job = json.loads(capsys.readouterr().out)
    assert job["state"] == "done" and job["blocks_warmed"] == dry["estimate"]["blocks_to_compute"]

    assert main([*base, "report", job["job_id"]]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["totals"]["items_covered"] == 2
    assert main([*base, "list"]) == 0
    assert [j["job_id"] for j in json.loads(capsys.readouterr().out)["jobs"]] == [job["job_id"]]
    assert main([*base, "cancel", job["job_id"]]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "done"  # finished: unchanged
    assert main(["warmup", "--server", w.server.address, "report", job["job_id"]]) == 0
    assert "2/2 items fully cached" in capsys.readouterr().out
    assert main([*base, "status", "nope"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
