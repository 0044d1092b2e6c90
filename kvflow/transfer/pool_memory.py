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

``populate`` maps a span of pool memory ahead of its first write without writing it
(``MADV_POPULATE_WRITE``, Linux 5.14): what a write would fault in, done when the caller
chooses (the kvdb DRAM tier's write-ahead, ``kvdb/dram.py``), and safe beside threads that
write the same span, since it changes no byte.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

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


MADV_POPULATE_WRITE = 23
"""Linux's advice to populate page tables writable, as a write would, without writing
(``<linux/mman.h>``, since 5.14)."""
PAGE = mmap.PAGESIZE

_madvise: Any = None  # libc's madvise once looked up; False where there is none


def populate(region: np.ndarray, start: int, end: int) -> bool:
    """Map the pages under ``region[start:end]`` (a contiguous uint8 array over pool memory)
    writable now, without writing them: the bytes stay as they are, so a thread may write the
    span meanwhile. The span is widened to whole pages inside the region's mapping. Runs
    without the GIL (a libc call through ctypes). False where the platform cannot (not
    Linux, a kernel before 5.14, a mapping that refuses): nothing was done."""
    if not 0 <= start <= end <= region.nbytes:
        raise ValueError(f"span [{start}, {end}) is outside a region of {region.nbytes} bytes")
    madvise = _libc_madvise()
    if madvise is None or start == end:
        return madvise is not None
    base = region.ctypes.data
    lo = (base + start) // PAGE * PAGE
    hi = -(-(base + end) // PAGE) * PAGE
    if madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        logger.info("madvise(MADV_POPULATE_WRITE) failed: %s", os.strerror(err))
        return False
    return True


def _libc_madvise() -> Any:
    global _madvise
    if _madvise is None:
        _madvise = False
        path = ctypes.util.find_library("c")
        if path is not None and hasattr(os, "memfd_create"):  # Linux
            try:
                fn = ctypes.CDLL(path, use_errno=True).madvise
            except (OSError, AttributeError):
                fn = None
            if fn is not None:
                fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
                fn.restype = ctypes.c_int
                _madvise = fn
    return _madvise or None


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
