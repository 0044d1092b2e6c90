"""ExtentAllocator: first-fit allocation of byte ranges in one pool, with coalescing.

Pure bookkeeping (no memory is touched). Not thread-safe: the owner (DramTier's caller, the
shard) serialises calls under its lock.
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    """Hands out [offset, offset + size) ranges of a pool of ``capacity`` bytes.

    Sizes are rounded up to ``alignment`` (a power of two), so every offset is aligned. Free
    extents are kept sorted by offset and merged with their neighbours on free.
    """

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._starts: list[int] = [0] if self.capacity else []
        self._sizes: list[int] = [self.capacity] if self.capacity else []
        self.used = 0

    def rounded(self, size: int) -> int:
        """The bytes an allocation of ``size`` really takes."""
        a = self.alignment
        return max(a, (size + a - 1) & ~(a - 1))

    def allocate(self, size: int) -> int | None:
        """Offset of a new extent of ``size`` bytes, or None if no free extent is large enough."""
        need = self.rounded(size)
        for i, free in enumerate(self._sizes):
            if free >= need:
                offset = self._starts[i]
                if free == need:
                    del self._starts[i]
                    del self._sizes[i]
                else:
                    self._starts[i] = offset + need
                    self._sizes[i] = free - need
                self.used += need
                return offset
        return None

    def free(self, offset: int, size: int) -> None:
        """Return an extent given out by ``allocate(size)`` at ``offset``."""
        need = self.rounded(size)
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + need:
            raise ValueError(f"double free or overlap at offset {offset}")
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] > offset:
            raise ValueError(f"double free or overlap at offset {offset}")
        self.used -= need
        merge_prev = i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset
        merge_next = i < len(self._starts) and offset + need == self._starts[i]
        if merge_prev and merge_next:
            self._sizes[i - 1] += need + self._sizes[i]
            del self._starts[i]
            del self._sizes[i]
        elif merge_prev:
            self._sizes[i - 1] += need
        elif merge_next:
            self._starts[i] = offset
            self._sizes[i] += need
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, need)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        """The largest single free extent."""
        return max(self._sizes, default=0)

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, size) of every free extent, by offset (for tests and stats)."""
        return list(zip(self._starts, self._sizes, strict=True))
