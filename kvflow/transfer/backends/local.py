"""The local backend: both ends in this process, one memcpy per request."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.transfer.backends.base import Backend, TransferTask, copy_tasks
from kvflow.transfer.registry import register_backend
from kvflow.transfer.types import LOCAL_PEER, SegmentHandle, TransferRequest


@register_backend
class LocalBackend(Backend):
    """Copies between segments registered on this very engine (peer ``"local"``).

    submit copies synchronously on the calling thread: every task is terminal when it returns.
    """

    name = "local"

    def handles(self, peer: str) -> bool:
        return peer == LOCAL_PEER

    def open_segment(self, peer: str, name: str) -> SegmentHandle:
        segment = self.context.segments.by_name(name)
        return SegmentHandle(self.name, LOCAL_PEER, name, segment.segment_id, segment.size)

    def submit(self, tasks: Sequence[TransferTask]) -> None:
        copy_tasks(tasks, self._window)

    def _window(self, request: TransferRequest) -> memoryview:
        segment = self.context.segments.by_id(request.target.segment_id)
        return segment.window(request.remote_offset, request.length)
