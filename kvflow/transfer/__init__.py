"""kvflow.transfer: the transfer engine of Mooncake's Listing 1 and its backends.

Imports nothing of the rest of kvflow. See README.md in this folder.
"""

from __future__ import annotations

from kvflow.transfer.config import TransferConfig
from kvflow.transfer.engine import DEFAULT_BACKENDS, TransferEngine
from kvflow.transfer.errors import (
    BackendUnavailableError,
    BatchCapacityError,
    BatchNotFoundError,
    BatchPendingError,
    EngineClosedError,
    OutOfBoundsError,
    PeerUnreachableError,
    ProtocolError,
    ReadOnlySegmentError,
    SegmentExistsError,
    TransferError,
    TransferTimeoutError,
    UnknownSegmentError,
)
from kvflow.transfer.registry import backend_names, register_backend
from kvflow.transfer.types import (
    LOCAL_PEER,
    SHM_SCHEME,
    BatchId,
    MemoryHandle,
    OpCode,
    SegmentHandle,
    TransferRequest,
    TransferState,
    TransferStatus,
)

__all__ = [
    "DEFAULT_BACKENDS",
    "LOCAL_PEER",
    "SHM_SCHEME",
    "BackendUnavailableError",
    "BatchCapacityError",
    "BatchId",
    "BatchNotFoundError",
    "BatchPendingError",
    "EngineClosedError",
    "MemoryHandle",
    "OpCode",
    "OutOfBoundsError",
    "PeerUnreachableError",
    "ProtocolError",
    "ReadOnlySegmentError",
    "SegmentExistsError",
    "SegmentHandle",
    "TransferConfig",
    "TransferEngine",
    "TransferError",
    "TransferRequest",
    "TransferState",
    "TransferStatus",
    "TransferTimeoutError",
    "UnknownSegmentError",
    "backend_names",
    "register_backend",
]
