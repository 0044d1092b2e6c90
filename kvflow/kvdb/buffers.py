"""Views of caller buffers as flat uint8 numpy arrays, without copying.

Accepted: bytes / bytearray / memoryview / any C-contiguous buffer-protocol object, numpy arrays
and torch CPU tensors (any dtype; viewed as their raw bytes). The returned view aliases the
caller's memory: the caller keeps ownership and must keep it alive for the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvflow.kvdb.errors import InvalidBufferError


def _torch_view(tensor: Any, writable: bool) -> np.ndarray:
    if tensor.device.type != "cpu":
        raise InvalidBufferError(f"tensor must be on the CPU, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise InvalidBufferError("tensor must be contiguous")
    if writable and tensor.requires_grad:
        raise InvalidBufferError("tensor must not require grad")
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    return flat.numpy()


def _as_uint8(buf: Any, writable: bool) -> np.ndarray:
    if (
        type(buf) is np.ndarray
        and buf.dtype == np.uint8
        and buf.ndim == 1
        and buf.flags.c_contiguous
        and (buf.flags.writeable or not writable)
    ):
        return buf  # already a flat uint8 view: the hot path
    if type(buf).__module__.startswith("torch"):
        return _torch_view(buf, writable)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InvalidBufferError("numpy array must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise InvalidBufferError("numpy array is read-only")
        return buf.reshape(-1).view(np.uint8)
    try:
        view = memoryview(buf)
    except TypeError as exc:
        raise InvalidBufferError(
            f"expected a buffer (bytes, memoryview, numpy array, torch tensor), got "
            f"{type(buf).__name__}"
        ) from exc
    if not view.c_contiguous:
        raise InvalidBufferError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise InvalidBufferError("destination buffer is read-only")
    if view.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(view.cast("B"), dtype=np.uint8)


def readable_bytes(value: Any) -> np.ndarray:
    """A flat uint8 view of ``value``'s bytes (no copy). Raises InvalidBufferError."""
    return _as_uint8(value, writable=False)


def writable_bytes(buf: Any) -> np.ndarray:
    """A flat, writable uint8 view of ``buf`` (no copy). Raises InvalidBufferError."""
    return _as_uint8(buf, writable=True)
