"""Servers the doc-test blocks run against: the tiny demo model behind gRPC (the CLI blocks),
and the real default model behind HTTP (the README's first requests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.stages.serve.config import HttpConfig
from tests.e2e.conftest import ServerThread, base_config


@pytest.fixture(scope="module")
def tiny_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    """An embedded server on the tiny model, gRPC on a free port (long prompts fit)."""
    s = ServerThread(base_config(tiny_model, tmp_path_factory.mktemp("data"), num_pages=512))
    yield s
    s.close()


@pytest.fixture(scope="module")
def real_http_server(
    real_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerThread]:
    """The default model (SmolLM2-135M-Instruct) with its HTTP front on a free port."""
    s = ServerThread(
        base_config(
            real_model,
            tmp_path_factory.mktemp("data"),
            block_size=64,
            num_pages=64,
            staging_pages=64,
            prefill_chunk=512,
            max_tokens_limit=128,
        ),
        http=HttpConfig(port=0),
    )
    yield s
    s.close()
