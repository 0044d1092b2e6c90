"""The tcp backend against a real server on loopback: correctness, slicing, pool, bad requests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest

from kvflow.transfer import (
    PeerUnreachableError,
    SegmentHandle,
    TransferEngine,
    TransferState,
    UnknownSegmentError,
)
from kvflow.transfer.backends.tcp import TcpBackend

from .conftest import EngineFactory
from .helpers import random_bytes, read, write

KIB = 1 << 10
MIB = 1 << 20


@dataclass
class Pair:
    server: TransferEngine
    client: TransferEngine
    remote: np.ndarray
    local: np.ndarray
    target: SegmentHandle

    @property
    def tcp(self) -> TcpBackend:
        backend = self.client.backend("tcp")
        assert isinstance(backend, TcpBackend)
        return backend


def make_pair(
    make_engine: EngineFactory, rng: np.random.Generator, size: int, **client_fields: object
) -> Pair:
    server = make_engine(prefer_shm=False)
    remote = random_bytes(rng, size)
    server.register_memory("remote", remote)
    server.start_server()
    client = make_engine(prefer_shm=False, **client_fields)
    local = np.zeros(size, dtype=np.uint8)
    client.register_memory("local", local)
    target = client.open_segment(server.peer_address, "remote")
    return Pair(server, client, remote, local, target)


@pytest.mark.parametrize(
    ("length", "offset"),
    [(1, 0), (100, 7), (64 * KIB, 0), (64 * KIB + 3, 1), (MIB, 4096), (3 * MIB + 17, 5)],
)
def test_read_and_write_many_sizes(
    make_engine: EngineFactory, rng: np.random.Generator, length: int, offset: int
) -> None:
    pair = make_pair(make_engine, rng, 4 * MIB, slice_size=256 * KIB)
    assert pair.target.backend == "tcp" and pair.target.size == 4 * MIB

    status = pair.client.transfer([read("local", 11, pair.target, offset, length)], timeout=10)[0]
    assert status.ok and status.transferred_bytes == length
    assert np.array_equal(pair.local[11 : 11 + length], pair.remote[offset : offset + length])
    assert not pair.local[:11].any() and not pair.local[11 + length :].any()

    payload = random_bytes(rng, length)
    pair.local[:length] = payload
    assert pair.client.transfer([write("local", 0, pair.target, offset, length)], timeout=10)[0].ok
    assert np.array_equal(pair.remote[offset : offset + length], payload)


def test_batch_of_many_values_in_shuffled_order(
    make_engine: EngineFactory, rng: np.random.Generator
) -> None:
    value = 128 * KIB
    pair = make_pair(make_engine, rng, 64 * value, slice_size=64 * KIB)
    order = rng.permutation(64)
    requests = [
        read("local", i * value, pair.target, int(j) * value, value) for i, j in enumerate(order)
    ]
    batch = pair.client.allocate_batch(len(requests))
    pair.client.submit(batch, requests)
    statuses = pair.client.wait(batch, timeout=10)
    pair.client.free_batch(batch)
    assert all(s.ok for s in statuses)
    for i, j in enumerate(order):
        assert np.array_equal(
            pair.local[i * value : (i + 1) * value], pair.remote[j * value : (j + 1) * value]
        )


def test_large_transfer_is_sliced_over_all_connections(
    make_engine: EngineFactory, rng: np.random.Generator
) -> None:
    pair = make_pair(make_engine, rng, 4 * MIB, slice_size=64 * KIB, connections_per_peer=4)
    length = 32 * 64 * KIB  # 32 slices dealt over 4 lanes: 8 slices, 512 KiB per connection
    assert pair.client.transfer([read("local", 0, pair.target, 64, length)], timeout=10)[0].ok
    assert np.array_equal(pair.local[:length], pair.remote[64 : 64 + length])
    stats = pair.tcp.endpoint_stats()
    assert sorted(key.lane for key in stats) == [0, 1, 2, 3]
    assert [s.bytes_received for s in stats.values()] == [8 * 64 * KIB] * 4
    assert [s.slices for s in stats.values()] == [8] * 4

    pair.local[:length] = random_bytes(rng, length)
    assert pair.client.transfer([write("local", 0, pair.target, 0, length)], timeout=10)[0].ok
    assert [s.bytes_sent for s in stats.values()] == [8 * 64 * KIB] * 4
    assert np.array_equal(pair.remote[:length], pair.local[:length])
    # a transfer that fits one slice uses one connection only
    before = {key: s.slices for key, s in stats.items()}
    assert pair.client.transfer([read("local", 0, pair.target, 0, 1000)], timeout=10)[0].ok
    assert sum(s.slices - before[key] for key, s in stats.items()) == 1


def test_bad_requests_fail_cleanly_and_the_server_keeps_serving(
    make_engine: EngineFactory, rng: np.random.Generator
) -> None:
    pair = make_pair(make_engine, rng, MIB, slice_size=64 * KIB, connections_per_peer=1)
    lying = dataclasses.replace(pair.target, size=1 << 40)  # skips the client-side check
    ghost = dataclasses.replace(pair.target, segment_id=999)
    before = pair.remote.copy()
    statuses = pair.client.transfer(
        [
            read("local", 0, lying, MIB - 10, 100),  # server: out of bounds
            write("local", 0, lying, MIB - 10, 200 * KIB),  # server drains the payload
            read("local", 0, ghost, 0, 10),  # server: unknown segment id
            read("local", 0, pair.target, MIB, 1),  # client: out of bounds
            read("local", 0, pair.target, 0, MIB),  # still served, same connection
        ],
        timeout=10,
    )
    states = [s.state for s in statuses]
    assert states == [TransferState.FAILED] * 4 + [TransferState.COMPLETED]
    assert statuses[0].error is not None and statuses[0].error.startswith("OutOfBoundsError")
    assert statuses[1].error is not None and statuses[1].error.startswith("OutOfBoundsError")
    assert statuses[2].error is not None and statuses[2].error.startswith("UnknownSegmentError")
    assert statuses[3].error is not None and "out of bounds" in statuses[3].error
    assert np.array_equal(pair.local, pair.remote)
    assert pair.tcp.retries == 0  # errors are answers, not broken links
    assert np.array_equal(pair.remote, before)  # the rejected WRITE touched nothing


def test_open_segment_errors(make_engine: EngineFactory, free_port: int) -> None:
    server = make_engine(prefer_shm=False)
    server.register_memory("there", bytearray(10))
    server.start_server()
    client = make_engine(prefer_shm=False)
    with pytest.raises(UnknownSegmentError, match="absent"):
        client.open_segment(server.peer_address, "absent")
    with pytest.raises(PeerUnreachableError, match=str(free_port)):
        client.open_segment(f"127.0.0.1:{free_port}", "there")
    with pytest.raises(ValueError):
        client.open_segment("", "there")


def test_own_address_and_same_host_shm_shortcuts(make_engine: EngineFactory) -> None:
    owner = make_engine(engine_name="shortcut_owner")  # prefer_shm=True by default
    handle = owner.register_memory("kv", shm=True, size=8192)
    owner.register_memory("plain", bytearray(100))
    owner.start_server()
    assert owner.open_segment(owner.peer_address, "kv").backend == "local"
    user = make_engine()
    shm_target = user.open_segment(owner.peer_address, "kv")
    assert shm_target.backend == "shm" and shm_target.peer == "shm://shortcut_owner"
    assert user.open_segment(owner.peer_address, "plain").backend == "tcp"
    user.register_memory("local", bytearray(b"x" * 8192))
    assert user.transfer([write("local", 0, shm_target, 0, 8192)], timeout=5)[0].ok
    assert handle.buffer is not None and bytes(handle.buffer) == b"x" * 8192


def test_endpoint_pool_evicts_by_sieve_over_real_connections(
    make_engine: EngineFactory,
) -> None:
    client = make_engine(prefer_shm=False, max_endpoints=2, connections_per_peer=1)
    client.register_memory("local", bytearray(16))
    targets = {}
    for name in "ABC":
        server = make_engine(prefer_shm=False)
        server.register_memory("seg", bytearray(name.encode() * 16))
        server.start_server()
        targets[name] = client.open_segment(server.peer_address, "seg")
    tcp = client.backend("tcp")
    assert isinstance(tcp, TcpBackend)

    def touch(name: str) -> None:
        assert client.transfer([read("local", 0, targets[name], 0, 16)], timeout=5)[0].ok

    def peer_of(key: object) -> str:
        host, port = key.address  # type: ignore[attr-defined]
        return next(n for n, t in targets.items() if t.peer == f"{host}:{port}")

    for name in "ABA":
        touch(name)
    touch("C")  # A was hit (visited) so the hand skips it: B goes
    assert [peer_of(k) for k in tcp.pool.evictions] == ["B"]
    assert [peer_of(k) for k in tcp.pool.order()] == ["A", "C"]
    touch("B")  # B was the head, so the hand went back to the tail: A (bit cleared) goes
    assert [peer_of(k) for k in tcp.pool.evictions] == ["B", "A"]
    assert [peer_of(k) for k in tcp.pool.order()] == ["C", "B"]
    touch("C")
    touch("A")  # C is visited (cleared, skipped), B is not: B goes
    assert [peer_of(k) for k in tcp.pool.evictions] == ["B", "A", "B"]
    assert [peer_of(k) for k in tcp.pool.order()] == ["C", "A"]
    assert len(tcp.pool.endpoints()) == 2


def test_a_segment_read_only_for_peers_refuses_their_writes(
    make_engine: EngineFactory, rng: np.random.Generator
) -> None:
    server = make_engine(prefer_shm=False)
    remote = random_bytes(rng, 256 * KIB)
    before = remote.copy()
    server.register_memory("pool", remote, peer_writable=False)
    server.start_server()
    client = make_engine(prefer_shm=False, slice_size=64 * KIB)
    local = random_bytes(rng, 256 * KIB)
    client.register_memory("local", local)
    target = client.open_segment(server.peer_address, "pool")

    status = client.transfer([write("local", 0, target, 4096, 128 * KIB)], timeout=10)[0]
    assert not status.ok and status.error is not None
    assert status.error.startswith("ReadOnlySegmentError") and "read-only" in status.error
    assert np.array_equal(remote, before)  # nothing landed
    # the connection is still in step: a READ of the same segment works after the refusal
    status = client.transfer([read("local", 0, target, 8, 100 * KIB)], timeout=10)[0]
    assert status.ok and np.array_equal(local[: 100 * KIB], before[8 : 8 + 100 * KIB])
