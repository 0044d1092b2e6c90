"""`import kvflow.kvdb` stays light: no model engine, no server, no torch, no threads.

Checked in a fresh interpreter, because this test process has imported everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys, threading
import kvflow.kvdb
print(json.dumps({"modules": sorted(sys.modules), "threads": threading.active_count(),
                  "file": kvflow.__file__}))
"""


def test_import_kvdb_loads_no_engine_server_or_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert Path(report["file"]).resolve().parent == ROOT / "kvflow"
    modules = set(report["modules"])
    heavy = sorted(
        m
        for m in modules
        if m.split(".")[0] in {"torch", "sglang", "transformers", "safetensors", "tokenizers"}
        or m.startswith(("kvflow.stages", "kvflow.tools", "kvflow.router", "kvflow.pipeline"))
        or m.startswith("kvflow.integrations")
    )
    assert heavy == []
    assert "kvflow.kvdb" in modules
    assert report["threads"] == 1  # importing starts nothing
