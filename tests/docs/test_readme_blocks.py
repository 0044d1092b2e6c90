"""The README's first requests and the HTTP API page's examples, run as written against the
real default model (SmolLM2-135M-Instruct) behind the HTTP front: curl, the openai client."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import block
from tests.docs.shell import adapt, run_bash
from tests.e2e.conftest import ServerThread

pytestmark = pytest.mark.slow  # imports the real model (~15 s) and generates with it


def _http(server: ServerThread) -> str:
    assert server.http is not None
    return server.http.url.removeprefix("http://")


def test_readme_curl_chat(real_http_server: ServerThread, tmp_path: Path) -> None:
    out = run_bash(block("README.md", "readme-curl-chat"), tmp_path, http=_http(real_http_server))
    answer = json.loads(out.stdout)
    assert answer["object"] == "chat.completion"
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert answer["usage"]["prompt_tokens"] > 20


def test_readme_openai_client(real_http_server: ServerThread, tmp_path: Path) -> None:
    code = adapt(block("README.md", "readme-openai-client"), http=_http(real_http_server))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3
    # each line: repr(answer), prompt tokens, cached tokens
    (cold, _, cold_cached), (warm, _, warm_cached), (_, _, other_cached) = (
        line.rsplit(" ", 2) for line in lines
    )
    assert cold_cached == "0" and int(warm_cached) >= 192  # the repeat reads the system prompt
    assert warm == cold  # and gives the cold run's answer
    assert int(other_cached) >= 128  # another question shares the system prompt's blocks


def test_http_generate_and_refused(real_http_server: ServerThread, tmp_path: Path) -> None:
    http = _http(real_http_server)
    out = run_bash(block("http-api.md", "http-generate"), tmp_path, http=http)
    answer = json.loads(out.stdout)
    assert "Rome" in answer["text"]
    assert answer["meta_info"]["finish_reason"]["type"] == "stop"
    out = run_bash(block("http-api.md", "http-refused"), tmp_path, http=http)
    assert out.stdout.strip() == "400"
