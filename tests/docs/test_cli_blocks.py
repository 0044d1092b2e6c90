"""The docs' command-line blocks, run as written (bash, the kvflow CLI as a subprocess) against
a real embedded server on the tiny demo model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.docs.blocks import block
from tests.docs.shell import run_bash
from tests.e2e.conftest import ServerThread

pytestmark = pytest.mark.slow  # each block starts a few CLI processes (~1-2 s each)


def test_quickstart_generate_hits_the_cache(tiny_server: ServerThread, tmp_path: Path) -> None:
    out = run_bash(
        block("quickstart.md", "quickstart-generate"), tmp_path, grpc=tiny_server.address
    )
    first, second = (json.loads(line) for line in out.stdout.splitlines())
    assert first["cached_tokens"] == 0 and first["prompt_tokens"] > 1000
    assert second["cached_tokens"] >= 1000  # the shared prefix, in whole blocks
    assert sum(second["cached_by_tier"].values()) == second["cached_tokens"]


def test_quickstart_inspect_and_tracing(tiny_server: ServerThread, tmp_path: Path) -> None:
    tiny_server.generate("a request to trace " * 5)
    out = run_bash(block("quickstart.md", "quickstart-inspect"), tmp_path, grpc=tiny_server.address)
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["traceEvents"]
    assert "tokenize" in out.stdout and "p99 ms" in out.stdout  # the report's table
    assert "prefill-0" in out.stdout  # the shards table

    out = run_bash(block("tracing.md", "tracing-export-report"), tmp_path, grpc=tiny_server.address)
    assert out.stdout.count("p50 ms") == 2  # from the file and from the server


def test_kvdb_admin_views(tiny_server: ServerThread, tmp_path: Path) -> None:
    tiny_server.generate("blocks for the admin views " * 4)
    out = run_bash(block("kvdb-admin.md", "kvdb-admin-views"), tmp_path, grpc=tiny_server.address)
    shards = json.loads(out.stdout[out.stdout.rindex("\n[") :])  # the last one: --json shards
    assert len(shards) == 2 and "prefill-0" in json.dumps(shards)
    assert out.stdout.count("prefill-0") >= 3  # nodes, shards and tiers name it


def test_models_demo_model(tmp_path: Path) -> None:
    run_bash(block("models.md", "models-demo-model"), tmp_path)
    assert (tmp_path / "models" / "tiny" / "config.json").is_file()
    assert (tmp_path / "models" / "tiny" / "tokenizer.json").is_file()


def test_development_compiled_describe(tmp_path: Path) -> None:
    out = run_bash(block("development.md", "dev-compiled-describe"), tmp_path)
    assert out.stdout.startswith(("compiled", "pure Python", "interpreted"))


def test_simulator_replay_on_a_small_trace(tmp_path: Path) -> None:
    rng = random.Random(0)
    with open(tmp_path / "trace.jsonl", "w") as f:
        for i in range(60):  # a Mooncake-format trace: shared prefixes of hash ids
            prefix = list(range(rng.randrange(4) * 10, rng.randrange(4) * 10 + 8))
            own = [1000 + i * 10 + j for j in range(rng.randrange(1, 6))]
            ids = prefix + own
            f.write(
                json.dumps(
                    {
                        "timestamp": i * 200,
                        "input_length": len(ids) * 512,
                        "output_length": rng.randrange(4, 64),
                        "hash_ids": ids,
                    }
                )
                + "\n"
            )
    run_bash(block("simulator.md", "simulator-replay-small"), tmp_path)
    document = json.loads((tmp_path / "report.json").read_text())
    assert document["records"] == 60
    assert {run["params"]["policy"] for run in document["runs"]} == {"cache-aware", "random"}
