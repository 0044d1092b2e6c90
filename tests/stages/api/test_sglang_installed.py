"""SGLang's frontend as installed: docs/sglang.md's program run by a fresh Python process that
does a plain ``import sglang`` (the whole package, as a user's script does), against a real
embedded kvflow server over HTTP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import ServerThread
from tests.integrations.sglang_docs import doc_block

DOC_URL = "http://127.0.0.1:8000"


@pytest.mark.slow
def test_documented_frontend_program_runs_with_import_sglang(server: ServerThread) -> None:
    assert server.http is not None
    program = doc_block("sglang.md", "sglang-frontend")
    assert "import sglang as sgl" in program and DOC_URL in program
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-c", program.replace(DOC_URL, server.http.url)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer, verdict = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    expected = server.generate("Q: What is a KV cache?\nA:", max_tokens=8)[2]
    assert answer == repr(expected)
    assert verdict in ("yes", "no")
