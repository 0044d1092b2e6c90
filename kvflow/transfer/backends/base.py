"""The Backend interface: how the engine hands transfers to local, shm, tcp or rdma.

A backend is constructed with a :class:`BackendContext` (the engine's config and its table of
local segments), says which peers it ``handles``, turns (peer, name) into a SegmentHandle with
``open_segment``, and executes tasks given to ``submit``. It reports each task only through the
task's RequestProgress (see kvflow.transfer.batch): it must call ``expect_slices`` once, then
``settle_slice`` exactly that many times, whatever happens.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from kvflow.transfer.batch import RequestProgress
from kvflow.transfer.config import TransferConfig
from kvflow.transfer.errors import TransferError
from kvflow.transfer.memory import SegmentTable
from kvflow.transfer.types import OpCode, SegmentHandle, TransferRequest


@dataclass(frozen=True)
class BackendContext:
    """What every backend is constructed with (the same for all of them)."""

    config: TransferConfig
    segments: SegmentTable
    clock: Callable[[], float] = field(default=time.monotonic)


@dataclass(frozen=True)
class TransferTask:
    """One request bound to its local memory and its progress record.

    ``local`` is the window [local_offset, +length) of the local segment; the backend writes into
    it (READ) or reads from it (WRITE) and must not touch it after its last settle_slice.
    """

    request: TransferRequest
    local: memoryview
    progress: RequestProgress


class Backend(ABC):
    """A way of moving bytes. Implementations are picked by name from the registry.

    Thread-safety: ``submit`` and ``open_segment`` may be called from several threads at once.
    ``close`` stops every thread the backend started; tasks still running end FAILED.
    """

    name: ClassVar[str]

    def __init__(self, context: BackendContext) -> None:
        self.context = context

    @classmethod
    def available(cls) -> bool:
        """Whether this backend can run on this host (libraries and devices present)."""
        return True

    @abstractmethod
    def handles(self, peer: str) -> bool:
        """Whether ``peer`` is addressed to this backend (e.g. "local", "shm://x", "host:port")."""

    @abstractmethod
    def open_segment(self, peer: str, name: str) -> SegmentHandle:
        """Look up segment ``name`` at ``peer``.

        Raises UnknownSegmentError if the peer has no such segment, PeerUnreachableError if the
        peer cannot be reached.
        """

    @abstractmethod
    def submit(self, tasks: Sequence[TransferTask]) -> None:
        """Start the tasks (all targets belong to this backend). Never raises for transfer
        failures: those end up in the tasks' progress. May run the copies before returning."""

    def close(self) -> None:  # noqa: B027 - a backend without resources needs no close
        """Release connections, mappings and threads. Idempotent."""


def settle_failed(task: TransferTask, error: BaseException | str, *, timeout: bool = False) -> None:
    """Fail a task that was never split: declare one slice, fail and settle it."""
    task.progress.expect_slices(1)
    task.progress.fail(error, timeout=timeout)
    task.progress.settle_slice()


def copy_tasks(
    tasks: Sequence[TransferTask], window: Callable[[TransferRequest], memoryview]
) -> None:
    """Run each task as one memcpy with the remote memory ``window(request)`` (the local and
    shm backends): every task is terminal on return; a TransferError fails only its task."""
    for task in tasks:
        progress = task.progress
        request = task.request
        progress.expect_slices(1)
        try:
            remote = window(request)
            progress.start()
            if request.opcode is OpCode.READ:
                copy_bytes(task.local, remote)
            else:
                copy_bytes(remote, task.local)
            progress.add_bytes(request.length)
        except TransferError as exc:
            progress.fail(exc)
        finally:
            progress.settle_slice()


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src through numpy, which releases the GIL while it copies (a memoryview
    assignment holds it) and copied faster here (5.9 against 4.9 GB/s, 64 MiB)."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
