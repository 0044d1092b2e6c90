"""Same-host sharing: the wire of the shm channel, its slot table, and the host id.

An engine that registers memory over a shared pool (``pool_memory.pool_bytes(shared=True)``)
serves it to same-host peers through an abstract unix socket named after the engine
(``socket_name``; ``shm_server.py``). A peer connects, proves the cluster key (the transfer
handshake) where the engine has one, and asks for segments by name; each answer carries the
pool's file descriptor (``SCM_RIGHTS``), read-only unless the segment is peer-writable, and the
peer maps it: one memcpy per transfer, no socket copy.

    server -> peer  HELLO: magic (8) | slots u64, with the slot table's descriptor (read-only)
    peer -> server  name length u16 | name (utf-8)
    server -> peer  REPLY: status u8 | writable u8 | pad 2 | slot u32 | segment_id u64 |
                    size u64 | offset u64, with the pool's descriptor when status is OK;
                    otherwise ``size`` bytes of utf-8 error message follow

The slot table is one small shared page: slot ``i`` holds the id of the i-th shared segment
and 0 once the owner unregistered it, so a peer checks that its mapping is still the segment
before each copy. A peer also checks that its connection is open: the owner's exit (even by
SIGKILL) closes it, and the mappings of a dead owner are never read.
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import struct
from functools import cache

from kvflow.transfer.errors import ProtocolError
from kvflow.transfer.protocol import recv_exact

MAGIC = b"KVFSHM02"
HELLO = struct.Struct("<8sQ")
REQUEST = struct.Struct("<H")
REPLY = struct.Struct("<BB2xIQQQ")
OK, UNKNOWN = 0, 1
SLOTS = 4096
"""Shared segments one engine can serve at once (a page of 32 KiB of u64 ids)."""
MAX_NAME = 1024
MAX_REFUSAL = 4096
"""The longest refusal message (UTF-8 bytes) a server sends after an UNKNOWN reply; a client
reads it whole, and takes a longer one as a broken connection."""
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def socket_name(engine_name: str) -> str:
    """The abstract unix socket (Linux) that serves ``engine_name``'s shared segments."""
    return f"kvflow-shm-{engine_name}"


def abstract_address(name: str) -> str:
    """The address of abstract socket ``name`` (no file: it lives in the network namespace)."""
    return "\0" + name


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a unix socket (``SO_PEERCRED``)."""
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return int(uid)


def send_with_fd(sock: socket.socket, data: bytes, fd: int | None) -> None:
    """Send ``data`` (small) with ``fd`` attached, in one message."""
    fds = [] if fd is None else [fd]
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_with_fd(sock: socket.socket, size: int) -> tuple[bytes, int | None]:
    """``size`` bytes and the descriptor sent with them (or None). Extra descriptors, which a
    well-behaved server never sends, are closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, size, 4)
    if not data:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("the shm server closed the connection")
    for extra in fds[1:]:
        os.close(extra)
    if len(data) < size:
        data += recv_exact(sock, size - len(data))
    return data, (fds[0] if fds else None)


def readonly_fd(fd: int) -> int:
    """A new read-only descriptor of the file behind ``fd`` (through /proc): a mapping made
    from it cannot be written, whatever the peer asks of mmap."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def map_fd(fd: int, length: int, writable: bool) -> mmap.mmap:
    """Map the first ``length`` bytes of ``fd``, shared, read-only unless ``writable``."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=prot)


class SlotTable:
    """The owner's table of shared segment ids (one memfd of ``SLOTS`` u64). Not thread-safe:
    the shm server calls it under its lock."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("kvflow-shm-slots", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, SLOTS * 8)
            self._map = map_fd(self.fd, SLOTS * 8, writable=True)
        except BaseException:
            os.close(self.fd)
            raise
        self._ids = memoryview(self._map).cast("Q")
        self._free = list(range(SLOTS - 1, -1, -1))

    def assign(self, segment_id: int) -> int | None:
        """A slot now holding ``segment_id``; None when every slot is taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._ids[slot] = segment_id
        return slot

    def clear(self, slot: int) -> None:
        self._ids[slot] = 0
        self._free.append(slot)

    def close(self) -> None:
        self._ids.release()
        self._map.close()
        os.close(self.fd)


@cache
def host_id() -> str:
    """Identifies this host (hostname and boot id), to tell whether a peer may share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
