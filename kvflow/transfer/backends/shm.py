"""The shm backend: a peer process on the same host, reached through POSIX shared memory.

The owner registers a segment with ``shm=True`` (it lives in /dev/shm under a name derived from
its engine name, see kvflow.transfer.shared); this backend maps it by that name and copies with
one memcpy, no socket. A header in the segment carries its id, which the owner zeroes when it
unregisters, so a stale mapping fails with UnknownSegmentError instead of reading dead memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory

from kvflow.transfer.backends.base import Backend, BackendContext, TransferTask, copy_tasks
from kvflow.transfer.errors import OutOfBoundsError, UnknownSegmentError
from kvflow.transfer.registry import register_backend
from kvflow.transfer.shared import (
    attach_shared,
    close_shared,
    data_view,
    read_header,
    shm_segment_name,
)
from kvflow.transfer.types import SHM_SCHEME, SegmentHandle

logger = logging.getLogger(__name__)


@dataclass
class _Mapping:
    shm: shared_memory.SharedMemory
    data: memoryview


@register_backend
class ShmBackend(Backend):
    """Maps same-host peers' shared memory segments (peers named ``shm://<engine_name>``).

    submit copies synchronously on the calling thread. Mappings are cached per (peer, name) and
    closed by close(). Thread-safe.
    """

    name = "shm"

    def __init__(self, context: BackendContext) -> None:
        super().__init__(context)
        self._lock = threading.Lock()
        self._mappings: dict[tuple[str, str], _Mapping] = {}

    def handles(self, peer: str) -> bool:
        return peer.startswith(SHM_SCHEME)

    def open_segment(self, peer: str, name: str) -> SegmentHandle:
        engine_name = peer[len(SHM_SCHEME) :]
        if not engine_name:
            raise ValueError(f"shm peer must be 'shm://<engine_name>', got {peer!r}")
        return self.attach(peer, name, shm_segment_name(engine_name, name))

    def attach(self, peer: str, name: str, shm_name: str) -> SegmentHandle:
        """Map ``shm_name`` (segment ``name`` of ``peer``); UnknownSegmentError if it is absent."""
        key = (peer, name)
        with self._lock:
            old = self._mappings.pop(key, None)
        if old is not None:
            self._close_mapping(old)
        try:
            shm = attach_shared(shm_name)
        except FileNotFoundError:
            raise UnknownSegmentError(
                f"segment {name!r} of {peer} is not in shared memory (no {shm_name})"
            ) from None
        try:
            segment_id, size = read_header(shm)
        except ValueError as exc:
            close_shared(shm, unlink=False)
            raise UnknownSegmentError(str(exc)) from None
        if segment_id == 0:
            close_shared(shm, unlink=False)
            raise UnknownSegmentError(f"segment {name!r} of {peer} was unregistered")
        with self._lock:
            self._mappings[key] = _Mapping(shm, data_view(shm, size))
        return SegmentHandle(self.name, peer, name, segment_id, size)

    def submit(self, tasks: Sequence[TransferTask]) -> None:
        copy_tasks(tasks, lambda req: self._window(req.target, req.remote_offset, req.length))

    def _window(self, target: SegmentHandle, offset: int, length: int) -> memoryview:
        with self._lock:
            mapping = self._mappings.get((target.peer, target.name))
        if mapping is None:
            raise UnknownSegmentError(f"segment {target.name!r} of {target.peer} is not open")
        segment_id, size = read_header(mapping.shm)
        if segment_id != target.segment_id:
            raise UnknownSegmentError(
                f"segment {target.name!r} of {target.peer} was unregistered (id "
                f"{target.segment_id} is gone)"
            )
        if offset + length > size:
            raise OutOfBoundsError(
                f"segment {target.name!r} (size {size}): offset {offset} + length {length} "
                "is out of bounds"
            )
        return mapping.data[offset : offset + length]

    def close(self) -> None:
        with self._lock:
            mappings = list(self._mappings.values())
            self._mappings.clear()
        for mapping in mappings:
            self._close_mapping(mapping)

    @staticmethod
    def _close_mapping(mapping: _Mapping) -> None:
        mapping.data.release()
        close_shared(mapping.shm, unlink=False)
