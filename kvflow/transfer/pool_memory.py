"""Pool memory: a large zeroed byte region that costs resident memory only as it is written.

The KV page pool and the kvdb DRAM tier are each one such region. It is an anonymous private
mapping, so the kernel maps zero pages on first write, and it asks for small pages
(``MADV_NOHUGEPAGE``): numpy marks large arrays for transparent huge pages, and where the
kernel's THP defrag setting is ``madvise`` (a common default, and this project's CI machine's)
the first write into each 2 MiB page of a marked region compacts memory on the spot, ~5 ms a
page on a busy host. A fresh server's prompt stores and mixed prefill steps paid that on the
request path (docs/performance.md).

A *shared* pool (``shared=True``, the kvdb DRAM tier) is the same, over a sealed memfd
(``memfd_create``: no file in /dev/shm, so no tmpfs size limit, and no name another process
could open) mapped ``MAP_SHARED``: the transfer engine can hand its file descriptor to an
authenticated same-host peer (``transfer/shm_server.py``), which then reads the pool with one
memcpy instead of two socket copies. ``shared_region`` finds the descriptor of such a pool's
array. Where memfd is missing (not Linux) a shared pool is a private one and shares nothing.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)


class _SharedMap(mmap.mmap):
    """A MAP_SHARED mapping of a whole memfd; ``fd`` stays open as long as the mapping."""

    fd: int


def pool_bytes(nbytes: int, *, shared: bool = False) -> np.ndarray:
    """A writable, zeroed uint8 array of ``nbytes`` over its own mapping (lazily mapped, small
    pages where the platform has ``MADV_NOHUGEPAGE``): anonymous and private, or with
    ``shared`` over a memfd that same-host peers can be given (``shared_region``). The
    mapping lives as long as the array and any view of it."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    region: mmap.mmap | None = _shared_map(nbytes) if shared else None
    if region is None:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        region.madvise(advice)
    return np.frombuffer(region, dtype=np.uint8)


WRITE_CHUNK = 64 << 20
"""``write_zeros`` hands each thread spans of at most this many bytes."""


def write_zeros(region: np.ndarray, threads: int | None = None) -> None:
    """Write zeros over ``region`` (a contiguous array over pool memory) on ``threads``
    threads (None: one per CPU this process may run on; a start-up's work), so the kernel
    maps all of its pages now rather than on first use. A first write into a page of a
    fresh mapping is a page fault, and on a virtual machine a fault into memory the guest
    never used costs far more than the write: 1.5 GiB took 4.0 s on one thread and 1.4 s on
    two on the 2-core development machine (docs/performance.md, "The KV pool written at
    start"). numpy's fill releases the GIL, so the threads fault in parallel."""
    if threads is None:
        threads = _cpus()
    flat = region.reshape(-1).view(np.uint8)
    n = flat.nbytes
    spans = [(at, min(n, at + WRITE_CHUNK)) for at in range(0, n, WRITE_CHUNK)]
    if threads <= 1 or len(spans) <= 1:
        flat.fill(0)
        return
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                if not spans or errors:
                    return
                start, end = spans.pop()
            try:
                flat[start:end].fill(0)
            except BaseException as exc:  # re-raised on the caller's thread
                with lock:
                    errors.append(exc)
                return

    workers = [
        threading.Thread(target=work, name=f"pool-write-{i}", daemon=True)
        for i in range(min(threads, len(spans)))
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _shared_map(nbytes: int) -> _SharedMap | None:
    create = getattr(os, "memfd_create", None)
    if create is None:
        return None
    fd = create("kvflow-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        if _SEALS:  # nobody, not even a peer given a writable descriptor, resizes it
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        region = _SharedMap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    region.fd = fd
    weakref.finalize(region, os.close, fd)
    return region


def shared_region(buffer: Any) -> tuple[int, int, int] | None:
    """(fd, offset, size) of the memfd bytes under ``buffer`` when it is a numpy array over a
    shared pool (or a contiguous slice of one); None for anything else."""
    if not isinstance(buffer, np.ndarray) or not buffer.flags.c_contiguous:
        return None
    base: Any = buffer
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer's base
        base = base.obj
    if not isinstance(base, _SharedMap) or base.closed:
        return None
    start = np.frombuffer(base, dtype=np.uint8).ctypes.data
    offset = buffer.ctypes.data - start
    if not 0 <= offset <= len(base) - buffer.nbytes:
        return None
    return base.fd, offset, buffer.nbytes
