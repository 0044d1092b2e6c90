"""Same-host sharing of a shared pool (pool_memory + shm_server + the shm backend): a peer
process maps the owner's pool through its socket after the key check, reads it with one memcpy,
cannot write what it was given read-only, and stops reading the moment the owner dies."""

from __future__ import annotations

import mmap
import os
import signal
import socket

import numpy as np
import pytest

from kvflow.transfer import OutOfBoundsError, TransferState, UnknownSegmentError
from kvflow.transfer.handshake import client_handshake
from kvflow.transfer.pool_memory import pool_bytes, shared_region
from kvflow.transfer.shared import (
    HELLO,
    OK,
    REPLY,
    REQUEST,
    abstract_address,
    recv_with_fd,
    socket_name,
)

from .conftest import EngineFactory
from .helpers import random_bytes, read, start_peer, write

SIZE = 4 << 20
KEY_A = b"a" * 32
KEY_B = b"b" * 32

linux_only = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create")
pytestmark = linux_only


def test_a_shared_pool_names_its_memfd_and_a_private_one_does_not() -> None:
    pool = pool_bytes(1 << 20, shared=True)
    fd, offset, size = shared_region(pool) or (-1, -1, -1)
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvflow-pool")
    assert (offset, size) == (0, 1 << 20)
    assert shared_region(pool[4096:8192])[1:] == (4096, 4096)  # type: ignore[index]
    assert shared_region(pool_bytes(1 << 20)) is None
    assert shared_region(np.zeros(10, np.uint8)) is None
    with pytest.raises(PermissionError):  # sealed: nobody resizes it under a mapping
        os.ftruncate(fd, 1 << 10)


def test_a_peer_process_reads_a_shared_pool_by_memcpy_and_stops_when_the_owner_dies(
    make_engine: EngineFactory,
) -> None:
    child, address = start_peer(SIZE, 7, "shared")
    try:
        expected = np.random.default_rng(7).integers(0, 256, size=SIZE, dtype=np.uint8)
        client = make_engine()  # prefer_shm: a same-host tcp peer's shared segment maps
        local = np.zeros(SIZE, dtype=np.uint8)
        client.register_memory("local", local)
        target = client.open_segment(address, "remote")
        assert target.backend == "shm" and target.size == SIZE
        statuses = client.transfer(
            [read("local", i << 20, target, (3 - i) << 20, 1 << 20) for i in range(4)], timeout=20
        )
        assert all(s.ok for s in statuses)
        for i in range(4):
            assert np.array_equal(
                local[i << 20 : (i + 1) << 20], expected[(3 - i) << 20 : (4 - i) << 20]
            )
        refused = client.transfer([write("local", 0, target, 0, 4096)], timeout=20)[0]
        assert refused.state is TransferState.FAILED
        assert "ReadOnlySegmentError" in (refused.error or "")

        child.send_signal(signal.SIGKILL)
        child.wait(timeout=20)
        local[:] = 0
        status = client.transfer([read("local", 0, target, 0, 1 << 20)], timeout=20)[0]
        assert status.state is TransferState.FAILED and "owner is gone" in (status.error or "")
        assert not local.any()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=20)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()


def test_a_peer_without_the_key_gets_no_descriptor(make_engine: EngineFactory) -> None:
    owner = make_engine(engine_name="keyed_owner", secret=KEY_A)
    owner.register_memory("kv", shm=True, size=8192)
    stranger = make_engine(secret=KEY_B)
    with pytest.raises(UnknownSegmentError, match="no shm owner"):
        stranger.open_segment("shm://keyed_owner", "kv")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # no handshake at all
        sock.settimeout(10)
        sock.connect(abstract_address(socket_name("keyed_owner")))
        sock.sendall(REQUEST.pack(2) + b"kv")
        data, fds, _, _ = socket.recv_fds(sock, 4096, 4)
        assert fds == [] and not data.startswith(b"KVFSHM")  # a challenge, then nothing
    friend = make_engine(secret=KEY_A)
    assert friend.open_segment("shm://keyed_owner", "kv").backend == "shm"


def test_a_read_only_segment_goes_out_as_a_read_only_descriptor(
    make_engine: EngineFactory, rng: np.random.Generator
) -> None:
    owner = make_engine(engine_name="ro_owner", secret=KEY_A)
    pool = pool_bytes(1 << 20, shared=True)
    pool[:] = random_bytes(rng, 1 << 20)
    handle = owner.register_memory("dram", pool[4096:], peer_writable=False)
    assert handle.shm_name == socket_name("ro_owner")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(abstract_address(handle.shm_name))
        client_handshake(sock, KEY_A)
        _hello, slots_fd = recv_with_fd(sock, HELLO.size)
        assert slots_fd is not None
        os.close(slots_fd)
        sock.sendall(REQUEST.pack(4) + b"dram")
        reply, fd = recv_with_fd(sock, REPLY.size)
        status, writable, _slot, _id, size, offset = REPLY.unpack(reply)
        assert (status, writable, size, offset) == (OK, 0, (1 << 20) - 4096, 4096)
        assert fd is not None
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, offset + size, flags=mmap.MAP_SHARED)  # asks for write access
            with pytest.raises(OSError):
                os.write(fd, b"x")
            with mmap.mmap(fd, offset + size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
                assert m[offset : offset + 64] == pool[4096 : 4096 + 64].tobytes()
        finally:
            os.close(fd)


def test_an_unshared_name_and_a_closed_owner_fail_clearly(make_engine: EngineFactory) -> None:
    owner = make_engine(engine_name="closing_owner")
    owner.register_memory("kv", shm=True, size=4096)
    owner.register_memory("plain", bytearray(4096))  # not a shared pool: tcp only
    user = make_engine()
    with pytest.raises(UnknownSegmentError, match="not shared here"):
        user.open_segment("shm://closing_owner", "plain")
    # a refusal longer than one read (the name's repr: 4 bytes a character) is read whole
    # and capped: the connection stays in step for the next request
    with pytest.raises(UnknownSegmentError, match="segment '") as refused:
        user.open_segment("shm://closing_owner", "\x01" * 1024)  # MAX_NAME bytes
    assert len(str(refused.value).encode()) > 4096
    target = user.open_segment("shm://closing_owner", "kv")
    user.register_memory("local", bytearray(4096))
    assert user.transfer([read("local", 0, target, 0, 4096)], timeout=5)[0].ok
    window = user.mapped_window(target, 16, 32)  # for a caller that copies it itself
    assert window.readonly and window.nbytes == 32
    with pytest.raises(OutOfBoundsError):
        user.mapped_window(target, 4090, 16)
    with pytest.raises(ValueError, match="shm segment handle"):
        user.mapped_window(user.open_segment("local", "local"), 0, 16)
    owner.close()
    with pytest.raises(UnknownSegmentError, match="owner is gone"):
        user.mapped_window(target, 0, 16)
    status = user.transfer([read("local", 0, target, 0, 16)], timeout=5)[0]
    assert status.state is TransferState.FAILED and "owner is gone" in (status.error or "")
    with pytest.raises(UnknownSegmentError, match="no shm owner"):
        user.open_segment("shm://closing_owner", "kv")
