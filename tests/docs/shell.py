"""Run a doc-test block as a reader would: bash (``-euo pipefail``) in a folder of the test's,
``.venv/bin/`` meaning this interpreter's bin folder, and the docs' default addresses
(127.0.0.1:50051 gRPC, 127.0.0.1:8000 HTTP) replaced by the test server's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
GRPC_DEFAULT = "127.0.0.1:50051"
HTTP_DEFAULT = "127.0.0.1:8000"


def adapt(text: str, grpc: str | None = None, http: str | None = None) -> str:
    """``text`` with the venv and the default addresses replaced (only those given)."""
    text = text.replace(".venv/bin/", f"{BIN}/")
    if grpc is not None:
        text = text.replace(GRPC_DEFAULT, grpc)
    if http is not None:
        text = text.replace(HTTP_DEFAULT, http)
    return text


def run_bash(
    text: str,
    cwd: Path,
    *,
    grpc: str | None = None,
    http: str | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run the block; a failing command fails the test with the block's output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", adapt(text, grpc, http)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert out.returncode == 0, f"block failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out
