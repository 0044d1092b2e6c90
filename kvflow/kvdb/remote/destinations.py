"""Destinations: where a remote reader's transfers may land — registered regions and one
staging buffer.

The transfer engine writes only into registered memory. A reader registers its big regions
(the KV page pool) once; a destination view that lies inside one is then addressed as (region
segment, offset) and read into directly. Anything else goes through the staging buffer,
registered once and grown (re-registered) only when a single block does not fit.

Thread-safety: ``register``/``unregister``/``locate`` are thread-safe; ``staging`` and the
staging buffer's contents belong to whoever holds ``staging_lock``.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.kvdb.buffers import writable_bytes
from kvflow.transfer import TransferEngine


@dataclass(frozen=True)
class _Region:
    name: str
    start: int
    end: int


def address(arr: np.ndarray) -> int:
    """The address of a numpy array's first byte."""
    return int(arr.__array_interface__["data"][0])


class Destinations:
    """Registered regions and the staging buffer of one reader on ``transfer``."""

    def __init__(self, transfer: TransferEngine, staging_bytes: int) -> None:
        self._transfer = transfer
        self._staging_bytes = staging_bytes
        self._tag = uuid.uuid4().hex[:12]  # segment names unique per reader on one engine
        self._names = itertools.count()
        self._lock = threading.Lock()
        self.staging_lock = threading.Lock()
        self._regions: list[_Region] = []
        self._staging: tuple[str, np.ndarray] | None = None

    def register(self, buffer: Any) -> str:
        """Register ``buffer`` (writable, contiguous) as a destination region; its name."""
        arr = writable_bytes(buffer)
        name = f"kvdb-dst-{self._tag}-{next(self._names)}"
        self._transfer.register_memory(name, arr)
        start = address(arr)
        with self._lock:
            self._regions.append(_Region(name, start, start + arr.shape[0]))
        return name

    def unregister(self, name: str) -> None:
        """Forget a region (UnknownSegmentError if it is not registered)."""
        with self._lock:
            self._regions = [r for r in self._regions if r.name != name]
        self._transfer.unregister_memory(name)

    def locate(self, dst: np.ndarray) -> tuple[str, int] | None:
        """(region name, offset) of ``dst`` if it lies wholly inside a region, else None."""
        start = address(dst)
        end = start + dst.shape[0]
        with self._lock:
            for region in self._regions:
                if region.start <= start and end <= region.end:
                    return region.name, start - region.start
        return None

    def staging(self, nbytes: int) -> tuple[str, np.ndarray]:
        """(segment name, buffer) of the staging buffer, at least ``nbytes`` long (call with
        ``staging_lock`` held)."""
        if self._staging is not None and self._staging[1].shape[0] >= nbytes:
            return self._staging
        if self._staging is not None:
            self._transfer.unregister_memory(self._staging[0])
            self._staging = None
        name = f"kvdb-staging-{self._tag}-{next(self._names)}"
        buf = np.empty(max(nbytes, self._staging_bytes), dtype=np.uint8)
        self._transfer.register_memory(name, buf)
        self._staging = (name, buf)
        return self._staging

    def forget_all(self) -> list[str]:
        """Drop every registration from the bookkeeping and return the names, for the caller
        to unregister (the engine may already be closed)."""
        with self._lock:
            names = [r.name for r in self._regions]
            self._regions = []
        with self.staging_lock:
            if self._staging is not None:
                names.append(self._staging[0])
                self._staging = None
        return names
