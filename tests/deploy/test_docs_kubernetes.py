"""docs/kubernetes.md: the blocks marked ``<!-- doc-test: ID -->`` run as written (read with
``tests/docs/blocks.py:block``); the shell blocks with bash in a temporary folder that links
the repository's ``deploy`` and ``tests`` folders, this environment's ``bin`` first on PATH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.manifests import ROOT, kubectl
from tests.docs.blocks import block

PAGE = "kubernetes.md"


def _run_sh(code: str, cwd: Path) -> str:
    for name in ("deploy", "tests"):
        (cwd / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed")
def test_render(tmp_path: Path) -> None:
    out = _run_sh(block(PAGE, "k8s-render"), tmp_path)
    assert int(out.strip().splitlines()[-1]) >= 10  # every object of the small overlay
    assert (tmp_path / "kvflow-small.yaml").stat().st_size > 0


def test_sizing() -> None:
    out = subprocess.run(
        [sys.executable, "-c", block(PAGE, "k8s-sizing")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "KV per token: 46080 bytes; one page: 2.81 MiB" in out
    assert "memory limit >=" in out


def test_sizing_numbers_are_the_default_models() -> None:
    """The page's shape numbers are the default model's (read from its GGUF file)."""
    from kvflow.stages.engine.default_model import default_gguf_path
    from kvflow.stages.engine.gguf_reader import hf_config, open_gguf

    config = hf_config(open_gguf(default_gguf_path()))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    shape = (config["num_hidden_layers"], config["num_key_value_heads"], head_dim)
    assert shape == (30, 3, 64)
    assert "layers, kv_heads, head_dim, dtype_bytes = 30, 3, 64, 4" in block(PAGE, "k8s-sizing")


def test_replay(tmp_path: Path) -> None:
    out = _run_sh(block(PAGE, "k8s-replay"), tmp_path)
    rows = [line for line in out.splitlines() if line.startswith("cache-aware")]
    assert len(rows) == 3
