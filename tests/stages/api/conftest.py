"""A real embedded cluster with its HTTP front on free ports (BackgroundServer), over the tiny
demo model given a chat template; the real default model (SmolLM2-135M-Instruct) imported
once per session where a test needs output that depends on cached KV."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow.stages.engine import write_demo_model
from kvflow.stages.serve.config import HttpConfig
from tests.e2e.conftest import ServerThread, base_config

BODY_LIMIT = 64 << 10
# A template in the shape of the common ones (role markers, a generation prompt).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-chat"
    write_demo_model(path, preset="tiny", seed=0)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return path


def http_server(model: Path, data_dir: Path, **overrides: Any) -> ServerThread:
    return ServerThread(
        base_config(model, data_dir, **overrides),
        http=HttpConfig(port=0, max_body_bytes=BODY_LIMIT),
    )


@pytest.fixture(scope="module")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    s = http_server(chat_model, tmp_path_factory.mktemp("data"))
    yield s
    s.close()


@pytest.fixture
def make_http_server(chat_model: Path, tmp_path: Path) -> Iterator[Any]:
    servers: list[ServerThread] = []

    def make(model: Path | None = None, **overrides: Any) -> ServerThread:
        s = http_server(model or chat_model, tmp_path / f"data{len(servers)}", **overrides)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()
