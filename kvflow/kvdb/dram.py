"""DramTier: one preallocated uint8 pool and its extent allocator.

The pool is allocated once at construction; blocks live in extents of it (no per-block Python
bytes objects). ``allocate``/``free`` are NOT thread-safe (the shard calls them under its
lock); ``view`` slices are safe to copy into or out of from any thread as long as the extent
is not freed meanwhile (the shard guarantees that with reader counts).

**Write-ahead.** A first write into a pool page is a page fault, and on a virtual machine
that hands free memory back to its host (free page reporting) a fault into memory the guest
has not used lately costs ~2-10 us a 4 KiB page (0.5-2.5 s of CPU per GiB of blocks a fresh
server caches; the price varies with the host), taken from the cores the engine computes on
(docs/performance.md, "The DRAM tier written ahead while idle"). ``write_ahead`` maps the
next span of the pool past the furthest extent ever allocated (the allocator is first-fit, so
the pool fills from its start) without writing it, up to ``reserve`` bytes ahead; its caller
runs it while the engine is idle (``runtime/worker.py``), so the next burst of stores finds
its pages mapped. Once blocks are
evicted, freed extents (already mapped) are reused first and the write-ahead has nothing left
to do.
"""

from __future__ import annotations

import numpy as np

from kvflow.kvdb.allocator import ExtentAllocator
from kvflow.transfer.pool_memory import pool_bytes, populate, write_zeros


class DramTier:
    """A pool of ``capacity`` bytes. ``prefault`` touches every page now rather than on first
    use (fewer page faults on the hot path, slower start); ``shared``: a shared pool that
    same-host peers can map (``pool_memory``), else private memory."""

    def __init__(
        self, capacity: int, alignment: int, prefault: bool = False, shared: bool = True
    ) -> None:
        self.pool = pool_bytes(capacity, shared=shared)
        if prefault and capacity:
            write_zeros(self.pool)
        self.allocator = ExtentAllocator(capacity, alignment)
        self.high_water = 0
        """The end of the furthest extent ever allocated (each is written by the put that
        allocated it): the pool below it is mapped."""
        self.mapped = self.allocator.capacity if prefault else 0
        """The end of the furthest span mapped ahead (``write_ahead``) or at start."""
        self._can_populate = True

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used

    def rounded(self, nbytes: int) -> int:
        return self.allocator.rounded(nbytes)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a fresh extent for ``nbytes``, or None if none is free."""
        if nbytes > self.capacity:
            return None
        offset = self.allocator.allocate(nbytes)
        if offset is not None:
            self.high_water = max(self.high_water, offset + self.allocator.rounded(nbytes))
        return offset

    def write_ahead(self, reserve: int, chunk: int) -> int:
        """Map at most ``chunk`` more bytes of the pool, so that up to ``reserve`` bytes past
        ``high_water`` are mapped; nothing before the first allocation (a tier never used
        costs no memory). Returns the bytes mapped now: 0 when the reserve is complete, the
        pool is mapped to its end, or the platform cannot (``pool_memory.populate``). Call
        it from one thread at a time; allocations may run meanwhile (it writes no byte)."""
        if not self._can_populate or self.high_water == 0 or reserve <= 0 or chunk <= 0:
            return 0
        start = max(self.mapped, self.high_water)
        end = min(self.allocator.capacity, self.high_water + reserve, start + chunk)
        if end <= start:
            return 0
        if not populate(self.pool, start, end):
            self._can_populate = False
            return 0
        self.mapped = end
        return end - start

    def free(self, offset: int, nbytes: int) -> None:
        self.allocator.free(offset, nbytes)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The pool bytes [offset, offset + nbytes) (a view, no copy)."""
        return self.pool[offset : offset + nbytes]
