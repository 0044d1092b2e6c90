"""Errors of kvdb: one base class, one subclass per broken contract or failure.

Misses, full tiers and partial batches are return values, not exceptions; these are for bad
input (wrong sizes, malformed buffers), integrity failures and unusable data directories.
"""

from __future__ import annotations


class KVDBError(Exception):
    """Base class of every kvdb error."""


class ValueSizeError(KVDBError, ValueError):
    """A value or destination buffer has the wrong number of bytes."""


class InvalidBufferError(KVDBError, ValueError):
    """A value or buffer is not a contiguous byte-addressable CPU buffer (or is read-only)."""


class InvalidKeyError(KVDBError, ValueError):
    """A block key is not 16 bytes."""


class ChecksumError(KVDBError):
    """A stored record failed its checksum or could not be decoded (corrupted or truncated)."""


class NamespaceMismatchError(KVDBError):
    """A client's namespace fingerprint differs from the one its shard serves."""


class IncompatibleDataDirError(KVDBError):
    """A data directory was written by an incompatible format version, engine or model."""


class DamagedManifestError(IncompatibleDataDirError):
    """The data directory's manifest cannot be read (truncated, overwritten)."""


class DataDirInUseError(KVDBError):
    """Another live process holds the data directory (its lock names the process)."""


class StoreFullError(KVDBError):
    """The storage device reported that it is full (e.g. ENOSPC, LMDB map full)."""


class StorageEngineError(KVDBError):
    """A storage engine failed for a reason other than a full device."""


class BlockPinnedError(KVDBError):
    """An explicit remove was asked for a block that is pinned by a running request."""


class NotPinnedError(KVDBError, ValueError):
    """unpin was asked for a key that holds no pin."""


class StoreClosedError(KVDBError):
    """The shard or client was used after close()."""


class InvalidRequestError(KVDBError, ValueError):
    """An admin or block-service request is malformed (bad key hex, negative size, unknown
    tier name...); the gRPC services answer INVALID_ARGUMENT."""


class AccessDeniedError(KVDBError):
    """An admin request that the caller's identity does not allow (a user key asking for a
    cluster-wide RPC or another tenant's view); the gRPC services answer PERMISSION_DENIED."""


class UnknownShardError(KVDBError, LookupError):
    """A request names a shard this server does not hold; the gRPC services answer NOT_FOUND."""


class RemoteReadError(KVDBError):
    """The control RPC of a remote read failed (holder unreachable, or it refused the
    request). Per-block transfer or checksum failures are misses, not this error.
    ``timed_out``: the holder did not answer within the deadline (paused, or a loaded host:
    it may well answer a later, more patient call); False for a refused or reset connection,
    a refused request. ``skipped``: nothing was sent, the holder's circuit breaker is open (it
    timed out or failed recently)."""

    def __init__(self, message: str, *, timed_out: bool = False, skipped: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.skipped = skipped


class NotEnoughReplicasError(KVDBError):
    """A put asked for N replicas but fewer than N distinct live members can hold a copy (or
    too few took one before the deadline); nothing was acknowledged."""
