"""Fixtures: transfer engines that are always closed, and seeded random bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvflow.transfer import TransferConfig, TransferEngine

EngineFactory = Callable[..., TransferEngine]


@pytest.fixture
def make_engine() -> Iterator[EngineFactory]:
    """make_engine(**config_fields) -> a TransferEngine closed at teardown."""
    engines: list[TransferEngine] = []

    def factory(backends: tuple[str, ...] | None = None, **fields: object) -> TransferEngine:
        config = TransferConfig(**fields)  # type: ignore[arg-type]
        engine = TransferEngine(config) if backends is None else TransferEngine(config, backends)
        engines.append(engine)
        return engine

    yield factory
    for engine in reversed(engines):
        engine.close()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
