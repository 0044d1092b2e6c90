"""Errors of the transfer engine, one hierarchy rooted at :class:`TransferError`.

Exceptions are raised for broken contracts on the caller's side (unknown local segment, a local
range out of bounds, a batch that does not exist or is still pending). Failures of a transfer
itself (a remote segment that is gone, a peer that cannot be reached, a timeout) are reported as
a FAILED or TIMEOUT :class:`~kvflow.transfer.types.TransferStatus` whose ``error`` text starts
with the name of one of these classes.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every error raised by kvflow.transfer."""


class UnknownSegmentError(TransferError, KeyError):
    """A segment name or id is not registered (locally or at the peer)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SegmentExistsError(TransferError, ValueError):
    """register_memory was called with a name that is already registered."""


class OutOfBoundsError(TransferError, IndexError):
    """offset + length reaches beyond the end of a segment."""


class PeerUnreachableError(TransferError, ConnectionError):
    """No path to the peer could be connected (every address failed)."""


class BatchNotFoundError(TransferError, KeyError):
    """The batch id was never allocated or has been freed."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class BatchPendingError(TransferError, RuntimeError):
    """free_batch was called while some of the batch's transfers are still running."""


class BatchCapacityError(TransferError, ValueError):
    """submit would put more requests in a batch than its allocated capacity."""


class BackendUnavailableError(TransferError, RuntimeError):
    """A backend was asked for that is not registered or cannot run on this host."""


class ReadOnlySegmentError(TransferError, PermissionError):
    """A peer's WRITE to a segment its owner registered read-only for peers."""


class ProtocolError(TransferError):
    """The peer sent bytes that do not follow the wire protocol."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not finish within its deadline."""


class EngineClosedError(TransferError, RuntimeError):
    """The engine (or one of its backends) has been closed."""


class HandshakeError(TransferError, ConnectionError):
    """A connection's peer did not prove the transfer key (``transfer.handshake``)."""
