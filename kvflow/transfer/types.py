"""Pure data of the transfer engine: opcodes, requests, statuses and handles.

Nothing here does I/O; every record is a frozen dataclass so that it can be shared between
threads and compared in tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

BatchId = NewType("BatchId", int)
"""Names one batch of transfer requests inside one engine (see TransferEngine.allocate_batch)."""

LOCAL_PEER = "local"
"""The peer name that means "this engine itself" (same-process memcpy)."""

SHM_SCHEME = "shm://"
"""Prefix of a same-host peer reached through shared memory: ``shm://<engine_name>``."""


class OpCode(enum.Enum):
    """Direction of a transfer, seen from the local buffer (as in Mooncake's Listing 1).

    READ copies target[remote_offset : +length] into the local buffer; WRITE copies the local
    buffer into the target.
    """

    READ = "read"
    WRITE = "write"


class TransferState(enum.Enum):
    """Life of one request: WAITING (accepted, not started) -> PENDING (bytes moving) ->
    COMPLETED | FAILED | TIMEOUT (terminal)."""

    WAITING = "waiting"
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({TransferState.COMPLETED, TransferState.FAILED, TransferState.TIMEOUT})


@dataclass(frozen=True)
class SegmentHandle:
    """A segment that transfers can target, as returned by TransferEngine.open_segment.

    backend: the backend that serves it ("local", "shm", "tcp", "rdma").
    peer: where it lives ("local", "shm://<engine>", "host:port[,host:port...]").
    name: the name it was registered under at its owner.
    segment_id: the owner's id for this registration (a re-registration gets a new id, so a stale
        handle fails with UnknownSegmentError instead of touching the wrong memory).
    size: its length in bytes when the handle was opened.
    """

    backend: str
    peer: str
    name: str
    segment_id: int
    size: int


@dataclass(frozen=True)
class MemoryHandle:
    """A registered local memory region (TransferEngine.register_memory).

    ``buffer`` is a writable one-byte-per-item memoryview of the region, owned by the engine until
    unregister_memory; for segments registered with ``shm=True`` it is the only way to reach the
    shared memory. ``shm_name`` is the socket that serves it to same-host peers (the engine's
    shm server), or None where it is not shared.
    """

    name: str
    segment_id: int
    size: int
    shm_name: str | None = None
    buffer: memoryview | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TransferRequest:
    """One entry of a batch: move ``length`` bytes between a local registered segment and a target.

    local_segment: name of a region registered with register_memory on the submitting engine.
    local_offset: byte offset inside that region.
    target: the remote (or local) segment, from open_segment.
    remote_offset: byte offset inside the target.
    length: bytes to move, > 0.

    Raises ValueError (naming the field) for negative offsets, non-positive length or a wrong type.
    """

    opcode: OpCode
    local_segment: str
    local_offset: int
    target: SegmentHandle
    remote_offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.opcode, OpCode):
            raise ValueError(f"opcode must be an OpCode, got {self.opcode!r}")
        if not isinstance(self.local_segment, str) or not self.local_segment:
            raise ValueError(f"local_segment must be a non-empty str, got {self.local_segment!r}")
        if not isinstance(self.target, SegmentHandle):
            raise ValueError(f"target must be a SegmentHandle, got {type(self.target).__name__}")
        for field_name in ("local_offset", "remote_offset"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field_name} must be an int >= 0, got {value!r}")
        if not isinstance(self.length, int) or isinstance(self.length, bool) or self.length <= 0:
            raise ValueError(f"length must be an int > 0, got {self.length!r}")


@dataclass(frozen=True)
class TransferStatus:
    """Snapshot of one request's progress.

    transferred_bytes counts bytes confirmed moved (it reaches ``length`` on COMPLETED).
    error is None unless state is FAILED or TIMEOUT; then it starts with the error class name,
    e.g. ``"OutOfBoundsError: ..."``.
    """

    state: TransferState
    transferred_bytes: int = 0
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.state.terminal

    @property
    def ok(self) -> bool:
        return self.state is TransferState.COMPLETED
