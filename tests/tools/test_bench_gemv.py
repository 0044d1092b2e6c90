"""The decode matrix-vector microbenchmark runs end to end on a small pass and reports every
variant at every row count, its ratios against the replaced kernel, in its --json."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from kvflow.tools.bench import gemv


@pytest.mark.skipif(
    sys.platform != "linux"
    or shutil.which("cc") is None
    or not torch.backends.mkldnn.is_available(),
    reason="the kernels are built on Linux with a C compiler, beside oneDNN",
)
def test_bench_gemv_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gemv.json"
    saved = torch.get_num_threads()
    try:
        code = gemv.main(["--layers", "1", "--rows", "1,3", "--repeat", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(saved)
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert {(r["rows"], r["variant"]) for r in results} == {
        (m, v) for m in (1, 3) for v in gemv.VARIANTS
    }
    assert all(r["best_ms"] > 0 and r["speedup_vs_old"] > 0 for r in results)
    assert [r["speedup_vs_old"] for r in results if r["variant"] == "old"] == [1.0, 1.0]
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("gemv: new kernel vs old") and "M3:" in summary


def test_bench_gemv_rejects_bad_rows() -> None:
    with pytest.raises(SystemExit):
        gemv.main(["--rows", "0"])
    with pytest.raises(SystemExit):
        gemv.main(["--variants", "fast"])
