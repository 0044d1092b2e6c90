"""BufferHandle (what ``get_buffer`` returns) and the address views the zero-copy calls use."""

from __future__ import annotations

import bisect
import ctypes
import threading

import numpy as np


class BufferHandle(bytearray):
    """An object's bytes, owned by the handle: ``ptr()`` its address, ``size()`` / ``len()``
    its size, and the buffer protocol (``bytes(h)``, ``memoryview(h)``) as Mooncake's."""

    def ptr(self) -> int:
        if not len(self):
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


def view_at(ptr: int, size: int) -> np.ndarray:
    """A writable uint8 view of ``[ptr, ptr + size)`` (the caller vouches for the memory, as
    Mooncake's callers do)."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))


class Regions:
    """Registered buffers: ``[start, end)`` ranges with their views. Registering a start
    twice is refused (as Mooncake does); lookups are lock-free reads of a replaced tuple."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: tuple[list[int], list[tuple[int, int, np.ndarray]]] = ([], [])

    def add(self, ptr: int, size: int) -> np.ndarray | None:
        with self._lock:
            if ptr in self._table[0]:
                return None
            view = view_at(ptr, size)
            regions = sorted([*self._table[1], (ptr, ptr + size, view)], key=lambda r: r[0])
            self._table = ([r[0] for r in regions], regions)
            return view

    def drop(self, ptr: int) -> bool:
        with self._lock:
            regions = [r for r in self._table[1] if r[0] != ptr]
            if len(regions) == len(self._table[1]):
                return False
            self._table = ([r[0] for r in regions], regions)
            return True

    def find(self, ptr: int, size: int) -> np.ndarray | None:
        """A view of ``[ptr, ptr + size)`` if one registered buffer holds it whole."""
        starts, regions = self._table
        i = bisect.bisect_right(starts, ptr) - 1
        for start, end, view in ([regions[i]] if i >= 0 else []) + regions[: max(i, 0)]:
            if start <= ptr and ptr + size <= end:
                return view[ptr - start : ptr - start + size]
        return None

    def room(self, ptr: int) -> int:
        """Bytes from ``ptr`` to the end of the registered buffer holding it (0: none)."""
        return max((end - ptr for start, end, _ in self._table[1] if start <= ptr < end), default=0)

    def clear(self) -> None:
        with self._lock:
            self._table = ([], [])


__all__ = ["BufferHandle", "Regions", "view_at"]
