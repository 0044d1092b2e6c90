"""Local memory: turning caller buffers into byte views, and the table of registered segments.

A *segment* is a region of this process's memory registered under a name. The engine and its
server read and write segments through memoryviews of one byte per item; nothing here copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

from kvflow.transfer.errors import OutOfBoundsError, SegmentExistsError, UnknownSegmentError
from kvflow.transfer.pool_memory import pool_bytes, shared_region

logger = logging.getLogger(__name__)


def as_byte_view(buffer: Any) -> memoryview:
    """A writable, C-contiguous, one-byte-per-item memoryview over ``buffer``'s memory (no copy).

    Accepts anything exposing the writable buffer protocol (bytearray, memoryview, mmap, numpy
    arrays), objects with ``__array_interface__``, and CPU DLPack producers such as a torch CPU
    tensor (read through numpy.from_dlpack; pass ``t.view(torch.uint8).numpy()`` or a memoryview
    if in doubt). The caller keeps ownership and must keep the object alive and unresized while
    it is registered.

    Raises TypeError for read-only, non-contiguous or non-buffer objects, ValueError if empty.
    """
    view = _raw_view(buffer)
    if view.readonly:
        raise TypeError(f"buffer must be writable, got a read-only {type(buffer).__name__}")
    if not view.c_contiguous:
        raise TypeError(f"buffer must be C-contiguous, got a strided {type(buffer).__name__}")
    try:
        flat = view if (view.format == "B" and view.ndim == 1) else view.cast("B")
    except TypeError as exc:  # exotic formats (structured dtypes) cannot be cast
        raise TypeError(f"buffer of format {view.format!r} cannot be viewed as bytes") from exc
    if flat.nbytes == 0:
        raise ValueError("buffer must not be empty")
    return flat


def _raw_view(buffer: Any) -> memoryview:
    try:
        return memoryview(buffer)
    except TypeError:
        pass
    import numpy as np

    if hasattr(buffer, "__array_interface__"):
        return memoryview(np.asarray(buffer))
    if hasattr(buffer, "__dlpack__"):
        try:
            array = np.from_dlpack(buffer)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise TypeError(f"cannot view {type(buffer).__name__} through DLPack: {exc}") from exc
        return memoryview(array)
    raise TypeError(
        "buffer must expose the buffer protocol or __array_interface__, got "
        f"{type(buffer).__name__}"
    )


@dataclass(frozen=True)
class LocalSegment:
    """One registered region: ``view`` is its byte view; ``region`` (fd, offset) where its
    bytes lie in a shared pool's memfd (``pool_memory``), else None; ``shm_name`` the socket
    that serves it to same-host peers once it is shared; ``peer_writable`` False: peers may
    READ it, their WRITEs are refused."""

    name: str
    segment_id: int
    view: memoryview
    region: tuple[int, int] | None = None
    peer_writable: bool = True
    shm_name: str | None = None

    @property
    def size(self) -> int:
        return self.view.nbytes

    def window(self, offset: int, length: int) -> memoryview:
        """The sub-view [offset, offset+length); OutOfBoundsError if it does not fit."""
        if offset < 0 or length < 0 or offset + length > self.view.nbytes:
            raise OutOfBoundsError(
                f"segment {self.name!r} (size {self.view.nbytes}): offset {offset} + length "
                f"{length} is out of bounds"
            )
        return self.view[offset : offset + length]


class SegmentTable:
    """The registered segments of one engine, by name and by id. Thread-safe.

    Ids start at 1 and are never reused, so a handle to an unregistered segment cannot reach a
    later registration that took its name.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, LocalSegment] = {}
        self._by_id: dict[int, LocalSegment] = {}
        self._next_id = 1

    def register(self, name: str, buffer: Any, peer_writable: bool = True) -> LocalSegment:
        """Register caller memory under ``name``; SegmentExistsError if the name is taken."""
        _check_name(name)
        view = as_byte_view(buffer)
        found = shared_region(buffer)
        region = None if found is None else found[:2]
        return self._add(name, view, region, peer_writable=peer_writable)

    def register_shared(self, name: str, size: int) -> LocalSegment:
        """Allocate ``size`` zeroed bytes of a shared pool and register them as ``name``.

        SegmentExistsError if the name is registered.
        """
        _check_name(name)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"size must be an int > 0 for a shm segment, got {size!r}")
        pool = pool_bytes(size, shared=True)
        found = shared_region(pool)
        if found is None:
            raise ValueError("shm=True: this platform has no memfd_create to share memory with")
        return self._add(name, memoryview(pool), found[:2])

    def _add(
        self,
        name: str,
        view: memoryview,
        region: tuple[int, int] | None,
        peer_writable: bool = True,
    ) -> LocalSegment:
        with self._lock:
            if name in self._by_name:
                raise SegmentExistsError(f"segment {name!r} is already registered")
            segment_id = self._next_id
            self._next_id += 1
            segment = LocalSegment(name, segment_id, view, region, peer_writable)
            self._by_name[name] = segment
            self._by_id[segment.segment_id] = segment
        logger.debug("registered segment=%s id=%d size=%d", name, segment.segment_id, segment.size)
        return segment

    def mark_shared(self, name: str, shm_name: str) -> LocalSegment:
        """Record that segment ``name`` is served to same-host peers by socket ``shm_name``."""
        with self._lock:
            segment = self._by_name.get(name)
            if segment is None:
                raise UnknownSegmentError(f"segment {name!r} is not registered")
            segment = dataclasses.replace(segment, shm_name=shm_name)
            self._by_name[name] = segment
            self._by_id[segment.segment_id] = segment
        return segment

    def unregister(self, name: str) -> LocalSegment:
        """Forget ``name`` and return what it was; UnknownSegmentError if not registered.
        Transfers still in flight on it may fail."""
        with self._lock:
            segment = self._by_name.pop(name, None)
            if segment is None:
                raise UnknownSegmentError(f"segment {name!r} is not registered")
            del self._by_id[segment.segment_id]
        return segment

    def by_name(self, name: str) -> LocalSegment:
        with self._lock:
            segment = self._by_name.get(name)
        if segment is None:
            raise UnknownSegmentError(f"segment {name!r} is not registered")
        return segment

    def by_id(self, segment_id: int) -> LocalSegment:
        with self._lock:
            segment = self._by_id.get(segment_id)
        if segment is None:
            raise UnknownSegmentError(f"segment id {segment_id} is not registered")
        return segment

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def clear(self) -> None:
        """Unregister everything (used by close)."""
        for name in self.names():
            with contextlib.suppress(UnknownSegmentError):
                self.unregister(name)


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or len(name.encode()) > 200:
        raise ValueError(f"name must be a non-empty str of at most 200 bytes, got {name!r}")
