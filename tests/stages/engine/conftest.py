"""Engine test fixtures: a tiny demo model written once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvflow.stages.engine import Engine, EngineConfig, cpu_attn, write_demo_model
from kvflow.stages.engine.cpu_attn import PagedKernel


@pytest.fixture
def kernel() -> PagedKernel:
    """The paged attention kernels (cpu_attn), built for this CPU."""
    bound = cpu_attn.kernel()
    assert bound is not None
    return bound


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """Put torch's thread count back after a test that sets it."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama made by transformers, with varied weights (greedy tokens differ)."""
    from tests.stages.engine.hf_models import make_hf_model

    return make_hf_model(tmp_path_factory.mktemp("hf-llama"), "llama", seed=1)


def open_engine(model_dir: Path, **overrides: object) -> Engine:
    """An fp32 engine with small pages so that tests cross page boundaries."""
    options: dict[str, object] = {
        "block_size": 8,
        "num_pages": 64,
        "prefill_chunk": 64,
        "return_logits": True,
    }
    options.update(overrides)
    return Engine.open(model_dir, EngineConfig(**options))  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def smol_dir(real_model: Path) -> Path:
    """The default model (SmolLM2-135M-Instruct): the session's one import (``real_model``)."""
    return real_model
