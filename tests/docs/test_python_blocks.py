"""The docs' Python snippets, run as written in a fresh interpreter (paths replaced by the
test's models)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import block

pytestmark = pytest.mark.slow  # a fresh interpreter imports torch and every command


def test_python_engine_api(tiny_model: Path, tmp_path: Path) -> None:
    code = block("python-api.md", "python-engine").replace('"models/tiny"', repr(str(tiny_model)))
    assert str(tiny_model) in code
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()  # the tokens generated after the imported prefix, decoded
