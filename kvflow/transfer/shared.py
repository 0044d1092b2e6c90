"""Shared memory helpers: create, attach and close POSIX shared memory segments, and the host id.

Python 3.11 registers every SharedMemory (also one merely attached) with the resource tracker,
which unlinks it when the attaching process exits. Attaching here unregisters it again, so only
the creator's exit or unregister_memory removes a segment.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from functools import cache
from multiprocessing import resource_tracker, shared_memory

logger = logging.getLogger(__name__)


def shm_segment_name(engine_name: str, segment: str) -> str:
    """The host-wide shared memory name of ``segment`` of engine ``engine_name``.

    POSIX names are short; the segment name is hex-encoded through blake2b when it would not fit
    or has characters outside [A-Za-z0-9_-].
    """
    import hashlib
    import re

    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", segment):
        return f"kvf_{engine_name}_{segment}"
    digest = hashlib.blake2b(segment.encode(), digest_size=12).hexdigest()
    return f"kvf_{engine_name}_h{digest}"


SHM_HEADER = struct.Struct("<8sQQ")
SHM_HEADER_BYTES = 64
"""A shm segment starts with a header (magic, segment id, size), then its data. The owner zeroes
the id when it unregisters, so a peer still mapping it sees the segment is gone."""
_MAGIC = b"KVFSHM01"

# Names this process created: the resource tracker is per process, so attaching to one of our
# own segments must not unregister it (the creator's unlink would then find no entry).
_created: set[str] = set()
_created_lock = threading.Lock()


def create_shared(name: str, size: int, segment_id: int) -> shared_memory.SharedMemory:
    """Create a segment of ``size`` data bytes; FileExistsError if the name is taken."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=SHM_HEADER_BYTES + size)
    SHM_HEADER.pack_into(shm.buf, 0, _MAGIC, segment_id, size)
    with _created_lock:
        _created.add(shm.name)
    return shm


def data_view(shm: shared_memory.SharedMemory, size: int) -> memoryview:
    """The data part of a segment (after the header)."""
    return shm.buf[SHM_HEADER_BYTES : SHM_HEADER_BYTES + size]


def read_header(shm: shared_memory.SharedMemory) -> tuple[int, int]:
    """(segment_id, size) of a mapped segment; segment_id 0 once the owner unregistered it.

    ValueError if the memory does not start with the kvflow header.
    """
    magic, segment_id, size = SHM_HEADER.unpack_from(shm.buf, 0)
    if magic != _MAGIC:
        raise ValueError(f"shm={shm.name} is not a kvflow transfer segment")
    return int(segment_id), int(size)


def tombstone(shm: shared_memory.SharedMemory) -> None:
    """Mark a segment as unregistered for peers that still map it."""
    SHM_HEADER.pack_into(shm.buf, 0, _MAGIC, 0, 0)


def attach_shared(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment created by another engine; FileNotFoundError if there is none."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    with _created_lock:
        ours = shm.name in _created
    if ours:  # the tracker entry is the creator's own: it must stay for its unlink
        return shm
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # pragma: no cover - tracker internals differ across versions
        logger.debug("could not unregister shm=%s from the resource tracker", name)
    return shm


def close_shared(shm: shared_memory.SharedMemory, *, unlink: bool) -> None:
    """Unmap (and, for the creator, unlink) a segment; a view still held elsewhere only warns."""
    try:
        shm.close()
    except BufferError:
        logger.warning("shm=%s still has views in use; unmapped at garbage collection", shm.name)
    if unlink:
        with _created_lock:
            _created.discard(shm.name)
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


@cache
def host_id() -> str:
    """Identifies this host (hostname and boot id), to tell whether a peer shares /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
