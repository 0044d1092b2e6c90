"""The decode attention benchmark times both settings and the read rate, and checks that the
settings agree."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvflow.stages.engine.cpu_attn import ENV_ATTN
from kvflow.tools.bench import decode_attention


def test_kv_bytes_counts_keys_and_values_of_every_layer() -> None:
    # 2 rows x 10 keys x 3 layers x (K and V) x 2 heads x 8 floats of 4 bytes
    assert decode_attention.kv_bytes(2, 10, 3, 2, 8) == 2 * 10 * 3 * 2 * 2 * 8 * 4


def test_quick_run_writes_both_settings_and_the_read_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_ATTN, "torch")
    out = tmp_path / "decode.json"
    argv = ["--rows", "3", "--context", "37", "--layers", "2", "--block", "8", "--rounds", "2"]
    assert decode_attention.main([*argv, "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("bench_decode_attention 3 rows x 37 tokens x 2 layers | read rate")
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"paged", "torch", "read"}
    for name in ("paged", "torch"):
        res = doc["results"][name]
        assert res["bytes"] == decode_attention.kv_bytes(3, 37, 2, 3, 64)
        assert res["seconds"] > 0 and res["gb_s"] > 0 and res["of_read_rate"] > 0
        assert res["max_abs_diff"] < 1e-4  # the kernel and torch's path agree
    assert doc["results"]["read"]["gb_s"] > 0
    assert os.environ[ENV_ATTN] == "torch"  # the setting put back
