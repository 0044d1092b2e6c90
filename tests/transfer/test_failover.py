"""Failures: a path dying mid-transfer, every path dead, a hung peer, pending batches."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.transfer import BatchPendingError, SegmentHandle, TransferState
from kvflow.transfer.backends.tcp import TcpBackend
from kvflow.transfer.endpoints import EndpointKey

from .conftest import EngineFactory
from .faults import FlakyProxy, SilentPeer
from .helpers import random_bytes, read

KIB = 1 << 10
MIB = 1 << 20


def _tcp(engine: object) -> TcpBackend:
    backend = engine.backend("tcp")  # type: ignore[attr-defined]
    assert isinstance(backend, TcpBackend)
    return backend


def test_a_path_dies_mid_transfer_and_the_rest_goes_over_the_other(
    make_engine: EngineFactory, rng: np.random.Generator
) -> None:
    server = make_engine(prefer_shm=False)
    remote = random_bytes(rng, 16 * MIB)
    server.register_memory("remote", remote)
    direct = server.start_server()
    proxy = FlakyProxy(direct, fail_after=MIB)  # path A: its link dies after 1 MiB
    try:
        peer = f"{proxy.address[0]}:{proxy.address[1]},{direct[0]}:{direct[1]}"
        client = make_engine(
            prefer_shm=False, slice_size=128 * KIB, connections_per_peer=2, path_retry_s=30.0
        )
        local = np.zeros(16 * MIB, dtype=np.uint8)
        client.register_memory("local", local)
        target = client.open_segment(peer, "remote")
        status = client.transfer([read("local", 0, target, 0, 16 * MIB)], timeout=20)[0]
        assert proxy.failed.is_set()
    finally:
        proxy.close()
    assert status.ok, status.error
    assert np.array_equal(local, remote)
    tcp = _tcp(client)
    stats = tcp.endpoint_stats()
    lane0_on_a = stats[EndpointKey(proxy.address, 0)]
    lane0_on_b = stats[EndpointKey(direct, 0)]
    assert lane0_on_a.failures == 1 and lane0_on_a.bytes_received < 8 * MIB
    assert lane0_on_b.bytes_received > 0  # lane 0 continued on path B
    # Lane 0's 64 slices of 128 KiB completed exactly once, over A or B. A slice that was in
    # flight when A died was re-sent over B, so its bytes may be counted on both paths.
    assert (lane0_on_a.slices + lane0_on_b.slices) * 128 * KIB == 8 * MIB
    moved = lane0_on_a.bytes_received + lane0_on_b.bytes_received
    assert 8 * MIB <= moved <= 8 * MIB + lane0_on_a.failures * 128 * KIB
    assert stats[EndpointKey(direct, 1)].bytes_received == 8 * MIB
    assert tcp.retries >= 1 and tcp.path_is_down(proxy.address)


def test_all_paths_dead_gives_failed_with_a_clear_error(
    make_engine: EngineFactory, rng: np.random.Generator
) -> None:
    server = make_engine(prefer_shm=False)
    server.register_memory("remote", random_bytes(rng, MIB))
    first = server.start_server()
    second = server.start_server()
    client = make_engine(prefer_shm=False, slice_size=64 * KIB, max_retries=2)
    client.register_memory("local", np.zeros(MIB, dtype=np.uint8))
    target = client.open_segment(server.peer_address, "remote")
    assert client.transfer([read("local", 0, target, 0, MIB)], timeout=10)[0].ok
    server.stop_server(first)
    server.stop_server(second)
    status = client.transfer([read("local", 0, target, 0, MIB)], timeout=20)[0]
    assert status.state is TransferState.FAILED
    assert status.error is not None and status.error.startswith("PeerUnreachableError")
    assert f"{first[1]}" in status.error or f"{second[1]}" in status.error


def test_a_hung_peer_ends_in_timeout(make_engine: EngineFactory) -> None:
    silent = SilentPeer()
    try:
        client = make_engine(prefer_shm=False, io_timeout_s=0.2, request_timeout_s=0.5)
        client.register_memory("local", bytearray(4096))
        target = SegmentHandle("tcp", silent.peer, "seg", 1, 1 << 20)
        batch = client.allocate_batch(1)
        client.submit(batch, [read("local", 0, target, 0, 4096)])
        with pytest.raises(BatchPendingError):
            client.free_batch(batch)
        statuses = client.wait(batch, timeout=10)
        assert [s.state for s in statuses] == [TransferState.TIMEOUT]
        assert statuses[0].error is not None and "TransferTimeoutError" in statuses[0].error
        client.free_batch(batch)
    finally:
        silent.close()


def test_closing_the_engine_fails_running_transfers(make_engine: EngineFactory) -> None:
    silent = SilentPeer()
    try:
        client = make_engine(prefer_shm=False, io_timeout_s=30.0)
        client.register_memory("local", bytearray(4096))
        target = SegmentHandle("tcp", silent.peer, "seg", 1, 1 << 20)
        batch = client.allocate_batch(2)
        client.submit(batch, [read("local", 0, target, 0, 100), read("local", 0, target, 9, 9)])
        assert client.wait(batch, timeout=0.05)[0].state in (
            TransferState.WAITING,
            TransferState.PENDING,
        )
        client.close()
        statuses = client.wait(batch, timeout=5)
        assert [s.state for s in statuses] == [TransferState.FAILED] * 2
        assert all("EngineClosedError" in (s.error or "") for s in statuses)
    finally:
        silent.close()
