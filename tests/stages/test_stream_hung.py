"""The KV stream into a hung decode side (a PausableProxy in front of its transfer server):
a batch ends at its deadline sized to the bytes with StreamTargetFailed naming the decode
side, its breaker opens (shared with opening the target), the next stream into it fails at
once, and a stream into a healthy decode side is unaffected. ABORTED is what the node API
answers, so the router blames the decode node.

Before: a batch waited the engine's io timeout (5 s) and retries, up to its 30 s timeout,
and the failure was INTERNAL (the router then blamed the prefill node)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from kvflow.kvdb import PeerBreakers, PeerCallBudget
from kvflow.pipeline import StageError
from kvflow.replication import BreakerConfig, BreakerState
from kvflow.stages.api.convert import status_for
from kvflow.stages.errors import StreamTargetFailed
from kvflow.stages.runtime.instances import pool_segment_name
from kvflow.stages.state import StreamTarget
from kvflow.stages.stream import StreamStage, open_stream_target
from kvflow.transfer import TransferConfig, TransferEngine
from tests.pausable_proxy import PausableProxy

PAGE = 4096
BUDGET = PeerCallBudget(base_s=0.3, breaker=BreakerConfig(failure_threshold=2, open_s=0.5))
CONFIG = TransferConfig(prefer_shm=False, request_timeout_s=10.0)


class DecodeSide:
    """A transfer server with a staging segment, reached through a pausable proxy."""

    def __init__(self) -> None:
        self.engine = TransferEngine(CONFIG)
        self.staging = np.zeros(8 * PAGE, dtype=np.uint8)
        self.engine.register_memory("staging", self.staging)
        host, port = self.engine.start_server()
        self.proxy = PausableProxy(f"{host}:{port}")

    def close(self) -> None:
        self.proxy.paused.clear()
        self.proxy.close()
        self.engine.close()


@pytest.fixture
def sides() -> Iterator[tuple[TransferEngine, list[DecodeSide]]]:
    prefill = TransferEngine(CONFIG)
    decodes = [DecodeSide(), DecodeSide()]
    yield prefill, decodes
    prefill.close()
    for d in decodes:
        d.close()


def _stream(
    prefill: TransferEngine, breakers: PeerBreakers, pool: torch.Tensor
) -> tuple[StreamStage, object]:
    stage = StreamStage(prefill, {"p0": pool}, 16, breakers)
    return stage, SimpleNamespace(prefill=SimpleNamespace(instance_id="p0"), stream_target=None)


def test_a_hung_decode_side_fails_the_stream_at_its_deadline_then_at_once(
    sides: tuple[TransferEngine, list[DecodeSide]],
) -> None:
    prefill, (hung, healthy) = sides
    pool = torch.arange(4 * PAGE, dtype=torch.uint8).reshape(4, PAGE)
    prefill.register_memory(pool_segment_name("p0"), pool.numpy())
    breakers = PeerBreakers(BUDGET)
    stage, state = _stream(prefill, breakers, pool)
    pages = {i: pool[i] for i in range(4)}
    targets = {}
    for d in (hung, healthy):
        segment = open_stream_target(prefill, breakers, d.proxy.address, "staging")
        targets[d.proxy.address] = StreamTarget(segment, [i * PAGE for i in range(4)], PAGE)
        state.stream_target = targets[d.proxy.address]  # type: ignore[attr-defined]
        assert stage._move(state, pages) == 4 * PAGE  # type: ignore[arg-type]
    assert np.array_equal(healthy.staging[: 4 * PAGE], pool.numpy().reshape(-1))

    hung.proxy.paused.set()
    state.stream_target = targets[hung.proxy.address]  # type: ignore[attr-defined]
    t0 = time.monotonic()
    with pytest.raises(StreamTargetFailed, match="page transfers failed") as err:
        stage._move(state, pages)  # type: ignore[arg-type]
    took = time.monotonic() - t0
    assert err.value.peer == hung.proxy.address
    assert took < BUDGET.deadline_s(4 * PAGE) + 0.7, took
    assert breakers.get(hung.proxy.address).state is BreakerState.OPEN
    t0 = time.monotonic()
    with pytest.raises(StreamTargetFailed, match="circuit open"):
        stage._move(state, pages)  # type: ignore[arg-type]
    with pytest.raises(StreamTargetFailed, match="circuit open"):
        open_stream_target(prefill, breakers, hung.proxy.address, "staging")
    assert time.monotonic() - t0 < 0.05

    state.stream_target = targets[healthy.proxy.address]  # type: ignore[attr-defined]
    t0 = time.monotonic()
    assert stage._move(state, pages) == 4 * PAGE  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 0.25


def test_a_stream_target_failure_is_aborted_on_the_wire() -> None:
    exc = StreamTargetFailed("127.0.0.1:1", "timed out")
    assert status_for(exc)[0] is grpc.StatusCode.ABORTED
    code, details = status_for(StageError("stream", "r1", exc))
    assert code is grpc.StatusCode.ABORTED and "127.0.0.1:1" in details
    assert status_for(StageError("stream", "r1", RuntimeError("x")))[0] is grpc.StatusCode.INTERNAL
