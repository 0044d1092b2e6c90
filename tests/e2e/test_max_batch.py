"""`--max-batch`: the most running requests one engine step decodes (default 64, vLLM's
`--max-num-seqs`). More may be running: each step decodes the least recently decoded, so
every stream advances and the outputs are a plain engine's."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.stages.runtime.step_trace import ENV
from kvflow.stages.serve.config import EngineStoreConfig
from kvflow.tools.args import add_engine_store_flags, engine_store_values
from kvflow.tools.bench import steps
from tests.e2e.conftest import BLOCK, assert_no_leaks
from tests.e2e.test_colocated import ids


def _max_batch(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    add_engine_store_flags(p)
    plan = SimpleNamespace(num_pages=8, staging_pages=8, dram_bytes=1 << 26, ssd_bytes=1 << 26)
    return int(engine_store_values(p.parse_args(argv), plan)["max_batch"])


def test_the_flag_and_its_default() -> None:
    assert _max_batch([]) == EngineStoreConfig.max_batch == 64
    assert _max_batch(["--max-batch", "3"]) == 3
    with pytest.raises(ValueError, match="max_batch"):
        EngineStoreConfig(max_batch=0)


def test_a_step_decodes_at_most_max_batch_and_every_stream_advances(
    make_server, tiny_model, tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV, str(tmp_path / "trace"))
    server = make_server(colocate=True, prefill_chunk=32, max_batch=2)
    assert server.cluster.prefill["prefill-0"].worker.engine.config.max_batch == 2
    prompts = [ids(20 + 7 * i, seed=i) for i in range(5)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: server.generate(p, max_tokens=8)[0], prompts))
    engine = Engine.open(tiny_model, EngineConfig(block_size=BLOCK, num_pages=128))
    assert got == engine.generate(prompts, SamplingParams(max_tokens=8))
    assert_no_leaks(server)
    server.close()  # the trace is complete
    (path,) = tmp_path.glob("trace.*.prefill-0.jsonl")
    records = steps.load(path)
    rows = [r["decode"] for r in records]
    assert max(rows) == 2, rows
    running, most = set(), 0  # decodes admitted and not yet finished, before each step
    for r in records:
        running |= {rid for rid, _ in r["admitted"] if rid.endswith("/decode")}
        most = max(most, len(running))
        running -= set(r["finished"])
    assert most > 2  # more were running than a step decodes: the cap held them
