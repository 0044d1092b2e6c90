"""DramTier: one preallocated uint8 pool and its extent allocator.

The pool is allocated once at construction; blocks live in extents of it (no per-block Python
bytes objects). ``allocate``/``free`` are NOT thread-safe (the shard calls them under its
lock); ``view`` slices are safe to copy into or out of from any thread as long as the extent
is not freed meanwhile (the shard guarantees that with reader counts).
"""

from __future__ import annotations

import numpy as np

from kvflow.kvdb.allocator import ExtentAllocator
from kvflow.transfer.pool_memory import pool_bytes, write_zeros


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
        return self.allocator.allocate(nbytes)

    def free(self, offset: int, nbytes: int) -> None:
        self.allocator.free(offset, nbytes)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The pool bytes [offset, offset + nbytes) (a view, no copy)."""
        return self.pool[offset : offset + nbytes]
