"""The engine API over the local (memcpy) and shm (same host) backends."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.transfer import (
    BatchCapacityError,
    BatchNotFoundError,
    OutOfBoundsError,
    SegmentExistsError,
    TransferState,
    UnknownSegmentError,
)

from .conftest import EngineFactory
from .helpers import random_bytes, read, write

SIZES_AND_OFFSETS = [(1, 0), (4096, 0), (4097, 3), (1 << 20, 12345), ((1 << 20) + 1, 1)]


@pytest.mark.parametrize(("length", "offset"), SIZES_AND_OFFSETS)
def test_local_read_and_write(
    make_engine: EngineFactory, rng: np.random.Generator, length: int, offset: int
) -> None:
    engine = make_engine()
    remote = random_bytes(rng, 2 << 20)
    local = np.zeros(2 << 20, dtype=np.uint8)
    engine.register_memory("remote", remote)
    engine.register_memory("local", local)
    target = engine.open_segment("local", "remote")
    assert target.backend == "local" and target.size == remote.nbytes

    statuses = engine.transfer([read("local", 7, target, offset, length)], timeout=5)
    assert [s.state for s in statuses] == [TransferState.COMPLETED]
    assert statuses[0].transferred_bytes == length
    assert np.array_equal(local[7 : 7 + length], remote[offset : offset + length])
    assert not local[:7].any() and not local[7 + length :].any()

    payload = random_bytes(rng, length)
    local[:length] = payload
    assert engine.transfer([write("local", 0, target, offset, length)], timeout=5)[0].ok
    assert np.array_equal(remote[offset : offset + length], payload)


def test_batch_lifecycle_and_errors(make_engine: EngineFactory, rng: np.random.Generator) -> None:
    engine = make_engine(max_batch_capacity=8)
    remote = random_bytes(rng, 1000)
    local = np.zeros(1000, dtype=np.uint8)
    engine.register_memory("remote", remote)
    engine.register_memory("local", local)
    target = engine.open_segment("local", "remote")

    batch = engine.allocate_batch(3)
    engine.submit(batch, [read("local", 0, target, 0, 100), read("local", 100, target, 100, 100)])
    with pytest.raises(BatchCapacityError, match="capacity 3"):
        engine.submit(batch, [read("local", 0, target, 0, 1)] * 2)
    with pytest.raises(OutOfBoundsError, match="'local'"):  # local side: raised, nothing added
        engine.submit(batch, [read("local", 950, target, 0, 100)])
    with pytest.raises(UnknownSegmentError, match="nope"):
        engine.submit(batch, [read("nope", 0, target, 0, 1)])
    assert len(engine.get_status(batch)) == 2
    engine.submit(batch, [read("local", 200, target, 990, 20)])  # remote side: a FAILED status
    statuses = engine.wait(batch, timeout=5)
    assert [s.state for s in statuses] == [TransferState.COMPLETED] * 2 + [TransferState.FAILED]
    assert statuses[2].error is not None and statuses[2].error.startswith("OutOfBoundsError")
    assert np.array_equal(local[:200], remote[:200])
    engine.free_batch(batch)
    with pytest.raises(BatchNotFoundError):
        engine.free_batch(batch)
    with pytest.raises(BatchNotFoundError):
        engine.get_status(batch)
    with pytest.raises(ValueError, match="capacity"):
        engine.allocate_batch(9)


def test_registration_errors_and_stale_handles(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.register_memory("a", bytearray(64))
    with pytest.raises(SegmentExistsError):
        engine.register_memory("a", bytearray(64))
    with pytest.raises(UnknownSegmentError):
        engine.open_segment("local", "b")
    engine.register_memory("buf", bytearray(64))
    stale = engine.open_segment("local", "a")
    engine.unregister_memory("a")
    engine.register_memory("a", bytearray(64))  # same name, new id
    status = engine.transfer([read("buf", 0, stale, 0, 8)], timeout=5)[0]
    assert status.state is TransferState.FAILED
    assert status.error is not None and "UnknownSegmentError" in status.error
    with pytest.raises(UnknownSegmentError):
        engine.unregister_memory("never")


@pytest.mark.parametrize(("length", "offset"), SIZES_AND_OFFSETS)
def test_shm_between_two_engines(
    make_engine: EngineFactory, rng: np.random.Generator, length: int, offset: int
) -> None:
    owner = make_engine(engine_name="owner")
    user = make_engine(engine_name="user")
    handle = owner.register_memory("kv", shm=True, size=2 << 20)
    assert handle.buffer is not None and handle.shm_name is not None
    data = random_bytes(rng, 2 << 20)
    handle.buffer[:] = data.tobytes()
    local = np.zeros(2 << 20, dtype=np.uint8)
    user.register_memory("local", local)
    target = user.open_segment("shm://owner", "kv")
    assert target.backend == "shm" and target.size == 2 << 20

    assert user.transfer([read("local", 5, target, offset, length)], timeout=5)[0].ok
    assert np.array_equal(local[5 : 5 + length], data[offset : offset + length])
    local[:length] = random_bytes(rng, length)
    assert user.transfer([write("local", 0, target, offset, length)], timeout=5)[0].ok
    assert bytes(handle.buffer[offset : offset + length]) == local[:length].tobytes()


def test_shm_peer_sees_unregistration(make_engine: EngineFactory) -> None:
    owner = make_engine(engine_name="owner2")
    user = make_engine(engine_name="user2")
    owner.register_memory("kv", shm=True, size=4096)
    user.register_memory("local", bytearray(4096))
    target = user.open_segment("shm://owner2", "kv")
    owner.unregister_memory("kv")
    status = user.transfer([read("local", 0, target, 0, 16)], timeout=5)[0]
    assert status.state is TransferState.FAILED and "unregistered" in (status.error or "")
    with pytest.raises(UnknownSegmentError):
        user.open_segment("shm://owner2", "kv")
