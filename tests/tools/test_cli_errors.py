"""`kvflow --version`, and a user's mistake on the command line: one line on stderr (or the
command's own one-line message) naming what is wrong, exit status 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow import __version__


def kvflow(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    return subprocess.run(
        [sys.executable, "-m", "kvflow.tools.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_version(tmp_path: Path) -> None:
    out = kvflow("--version", cwd=tmp_path)
    assert out.returncode == 0
    assert out.stdout == f"kvflow {__version__}\n"


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["serve", "--port", "x"], "argument --port: invalid int value: 'x'"),
        (["serve", "--role", "chef"], "argument --role: invalid choice: 'chef'"),
        (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        ([], "the following arguments are required: COMMAND"),
        (["kvdb", "--server", "127.0.0.1:1", "hot", "-n", "zero"], "argument -n"),
        (["cluster", "--port-base", "80"], "--port-base must be 0 or in [1024, 65535], got 80"),
        (["cluster", "--api-key-file", "missing-keys.txt"], "missing-keys.txt"),
        (["trace", "report", "--file", "missing.json"], "missing.json"),
        (["serve", "--model", "no-model-here"], "no-model-here has no config.json"),
        (["serve", "--model", "no-model-here", "--num-pages", "0"], "--num-pages must be positive"),
        (["serve", "--device", "tpu"], "device 'tpu': an engine runs on 'cpu' or 'cuda[:N]'"),
        (["serve", "--role", "node", "--device", "gpu"], "device 'gpu': an engine runs on"),
    ],
)
def test_a_mistake_is_one_line(tmp_path: Path, args: list[str], names: str) -> None:
    if "--num-pages" in args:  # the model must exist for the sizes to be checked
        (tmp_path / "no-model-here").mkdir()
        args = [a if a != "no-model-here" else str(_tiny(tmp_path)) for a in args]
    out = kvflow(*args, cwd=tmp_path)
    text = (out.stderr + out.stdout).strip()
    assert out.returncode == 2, text
    assert "Traceback" not in text
    # the error is one line; a first start may log before it (the generated cluster secret)
    errors = [line for line in text.splitlines() if " WARNING kvflow." not in line]
    assert len(errors) == 1, text
    assert names in errors[0]


def _tiny(tmp_path: Path) -> Path:
    from kvflow.stages.engine import write_demo_model

    return write_demo_model(tmp_path / "tiny", preset="tiny", seed=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_this_machine_lacks_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    model = str(_tiny(tmp_path))
    out = kvflow("serve", "--device", "cuda:0", "--model", model, cwd=tmp_path)
    text = (out.stderr + out.stdout).strip()
    assert out.returncode == 2, text
    assert "device 'cuda:0': this torch" in text and "sees no CUDA device" in text
    assert "Traceback" not in text
    out = kvflow("cluster", "--device", "cuda:0", "--model", model, cwd=tmp_path)
    text = (out.stderr + out.stdout).strip()
    assert out.returncode == 2 and "sees no CUDA device" in text and "Traceback" not in text


def test_a_model_the_engine_cannot_load_stops_the_start_in_one_line(tmp_path: Path) -> None:
    """The memory plan reads config.json alone; the engine then finds no tokenizer.json."""
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    (model / "config.json").write_bytes((_tiny(tmp_path) / "config.json").read_bytes())
    out = kvflow(
        "serve", "--model", str(model), "--port", "0", "--http-port", "0", "--metrics-port", "0",
        cwd=tmp_path,
    )  # fmt: skip
    text = (out.stderr + out.stdout).strip()
    assert out.returncode == 1, text
    assert "Traceback" not in text
    assert f"kvflow serve: cannot start: model directory {model} has no tokenizer.json" in text
