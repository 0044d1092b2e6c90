"""Exported traces hold a span for each of the seven stages; the CLI clients work."""

from __future__ import annotations

import json

import pytest

from kvflow.stages.api import pb2
from kvflow.tools.cli import main
from tests.e2e.test_reuse import ids

STAGES = ["tokenize", "hash", "route", "reuse-load", "prefill", "stream", "decode"]


def test_exported_trace_has_every_stage(server):
    _, usage, _ = server.generate(ids(70, seed=30))
    reply = server.stub.ExportTrace(pb2.ExportTraceRequest(), timeout=10)
    doc = json.loads(reply.chrome_trace_json)
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    mine = [e for e in events if e.get("args", {}).get("request_id", "") == usage.request_id]
    if not mine:  # the request id may live in the process metadata instead
        pids = {
            e["pid"]
            for e in doc["traceEvents"]
            if e.get("ph") == "M" and usage.request_id in json.dumps(e)
        }
        mine = [e for e in events if e["pid"] in pids]
    names = {e["name"] for e in mine}
    assert set(STAGES) <= names
    for e in mine:
        assert e["dur"] >= 0 and e["ts"] >= 0


def test_generate_json_cli(server, capsys):
    code = main(
        [
            "generate",
            "--server",
            server.address,
            "--prompt",
            "hello kvflow " * 10,
            "--max-tokens",
            "4",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert {"text", "token_ids", "prompt_tokens", "cached_tokens", "ttft_ms"} <= set(out)
    assert len(out["token_ids"]) == 4 and out["prompt_tokens"] > 0


def test_generate_cli_reports_errors(server, capsys):
    code = main(["generate", "--server", server.address, "--prompt", "x", "--tenant", "no way"])
    assert code == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


def test_trace_export_and_report_cli(server, tmp_path, capsys):
    server.generate(ids(40, seed=31))
    out = tmp_path / "t.json"
    assert main(["trace", "export", "--server", server.address, "--out", str(out)]) == 0
    json.loads(out.read_text())
    capsys.readouterr()
    assert main(["trace", "report", "--file", str(out)]) == 0
    table = capsys.readouterr().out
    for stage in STAGES:
        assert stage in table


def test_kvdb_admin_cli_against_the_server(server, capsys):
    prompt = ids(70, seed=32)
    server.generate(prompt)
    server.generate(prompt)  # a warm read: the blocks get hits
    capsys.readouterr()
    assert main(["kvdb", "--server", server.address, "shards", "--json"]) == 0
    shards = json.loads(capsys.readouterr().out)
    assert isinstance(shards, list) and shards
    assert main(["kvdb", "--server", server.address, "nodes", "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)
    assert {n["node"]: n["kind"] for n in nodes} == {"prefill-0": "prefill", "decode-0": "decode"}
    assert main(["kvdb", "--server", server.address, "hot", "-n", "3", "--json"]) == 0
    hot = json.loads(capsys.readouterr().out)
    assert len(hot) == 3 and all(h["hits"] >= 1 for h in hot)
    assert main(["kvdb", "--server", server.address, "replicas", hot[0]["key"], "--json"]) == 0
    assert "prefill-0" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main(["kvdb", "--server", server.address, "replicas", "zz"])
    assert bad.value.code == 2
