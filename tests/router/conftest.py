"""Fixtures for router tests: a tiny cost model where the numbers are easy to check by hand."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvflow.router import (
    Conductor,
    DecodeTimeModel,
    InstanceKind,
    InstanceState,
    LocalPrefixIndex,
    PrefillTimeModel,
    RouterConfig,
    TransferEstimator,
)

# 1 ms per new token, nothing else: prefill(n, p) = (n - p) / 1000 s.
LINEAR_PREFILL = PrefillTimeModel((0.0, 1e-3, 0.0, 0.0), "test-model")
# 10 ms per step + 1 ms per sequence in the batch.
SIMPLE_DECODE = DecodeTimeModel((1e-2, 1e-3, 0.0), "test-model")
BLOCK = 10  # tokens per block
BLOCK_NBYTES = 1000
BANDWIDTH = 1e6  # 1 ms per block


def keys(n: int, prefix: str = "k") -> tuple[bytes, ...]:
    return tuple(f"{prefix}{i}".encode() for i in range(n))


def make_conductor(
    index: LocalPrefixIndex, policy: str = "cache-aware", **overrides: object
) -> Conductor:
    fields: dict[str, object] = {
        "policy": policy,
        "block_size": BLOCK,
        "block_nbytes": BLOCK_NBYTES,
        "balancing_threshold": 2.0,
        "seed": 7,
    }
    fields.update(overrides)
    config = RouterConfig(**fields)  # type: ignore[arg-type]
    return Conductor(
        config, index, LINEAR_PREFILL, SIMPLE_DECODE, TransferEstimator(BANDWIDTH, 0.0)
    )


def instances(kind: InstanceKind, n: int) -> list[InstanceState]:
    return [InstanceState(f"{kind.value}-{i}", kind) for i in range(n)]


def load(states: Sequence[InstanceState], seconds: Sequence[float]) -> None:
    for state, s in zip(states, seconds, strict=True):
        if s:
            state.enqueue(f"busy-{state.instance_id}", s)


@pytest.fixture
def index() -> LocalPrefixIndex:
    return LocalPrefixIndex()


@pytest.fixture
def prefill() -> list[InstanceState]:
    return instances(InstanceKind.PREFILL, 2)


@pytest.fixture
def decode() -> list[InstanceState]:
    return instances(InstanceKind.DECODE, 2)
