"""The prefill attention benchmark runs both settings alternating and writes its JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvflow.stages.engine.cpu_attn import ENV_ATTN
from kvflow.tools.bench import prefill_attention


def test_chunk_flops_counts_visible_pairs() -> None:
    # queries 2..4 see 3, 4 and 5 keys: 12 pairs, 4 d each, per head
    assert prefill_attention.chunk_flops(2, 3, heads=2, d=8) == 4 * 8 * 2 * 12


def test_quick_run_writes_both_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_ATTN, "torch")
    out = tmp_path / "attn.json"
    argv = ["--tokens", "40", "--chunk", "16", "--layers", "2", "--rounds", "2"]
    assert prefill_attention.main([*argv, "--block", "8", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_prefill_attention 40 tokens x 2 layers")
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"paged", "torch"}
    for res in doc["results"].values():
        assert [c["start"] for c in res["chunks"]] == [0, 16, 32]
        assert [c["tokens"] for c in res["chunks"]] == [16, 16, 8]
        assert all(c["seconds"] > 0 and c["gflops"] > 0 for c in res["chunks"])
    assert os.environ[ENV_ATTN] == "torch"  # the setting put back
