"""Mooncake's tensor object format: a 304-byte TensorMetadata (magic "NOOM", version 1,
dtype code, ndim, layout kind FULL/SHARD, data offset and size, global and local shapes of up
to 8 dims, up to 4 layout axes) followed by the tensor's bytes (C order). Objects written by
``put_tensor`` here are byte-identical to Mooncake's. torch is imported on first use."""

from __future__ import annotations

import struct
from typing import Any

MAGIC = 0x4D4F4F4E
HEADER = struct.Struct("<IHHiiIIQQ")
SHAPE = struct.Struct("<8q")
AXIS = struct.Struct("<iiiiiiq")
META_SIZE = HEADER.size + 2 * SHAPE.size + 8 + 4 * AXIS.size  # 304
FULL, SHARD = 0, 1
AXIS_TP = 1
_DTYPES = [  # Mooncake's TensorDtype codes are the positions
    "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
    "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
]  # fmt: skip


def _torch() -> Any:
    import torch

    return torch


def _shape(dims: tuple[int, ...]) -> bytes:
    return SHAPE.pack(*dims, *([-1] * (8 - len(dims))))


def encode(tensor: Any, global_shape: tuple[int, ...] | None = None, axis: Any = None) -> bytes:
    """The object bytes of ``tensor`` (a CPU torch tensor); ValueError if Mooncake refuses
    it (not a tensor, an unsupported dtype, more than 8 dims). ``axis``: (rank, count,
    split_dim, reserved) of a TP shard of a tensor whose shape is ``global_shape``."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"not a torch.Tensor: {type(tensor).__name__}")
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPES or tensor.dim() > 8:
        raise ValueError(f"unsupported tensor: dtype {tensor.dtype}, {tensor.dim()} dims")
    local = tuple(tensor.shape) or (1,)
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    kind = FULL if axis is None else SHARD
    head = HEADER.pack(
        MAGIC, 1, META_SIZE, _DTYPES.index(name), len(local), kind, 0, META_SIZE, len(data)
    )
    axes = [AXIS.pack(AXIS_TP, 0, *axis[:3], 0, axis[3])] if axis is not None else []
    counts = struct.pack("<II", len(axes), 0)
    padding = AXIS.pack(0, 0, 0, 0, 0, 0, 0) * (4 - len(axes))
    layout = _shape(global_shape or local) + _shape(local) + counts + b"".join(axes) + padding
    return head + layout + data


def decode(raw: Any, copy: bool = True) -> Any:
    """The tensor in ``raw`` (bytes-like), or None if it is not one. ``copy`` False: a view
    of ``raw``'s memory (which must be writable), as Mooncake's ``get_tensor_into``."""
    view = memoryview(raw).cast("B")
    if view.nbytes < META_SIZE:
        return None
    magic, _ver, _hsize, dtype, ndim, _kind, _f, offset, nbytes = HEADER.unpack_from(view, 0)
    if magic != MAGIC or not 0 <= dtype < len(_DTYPES) or not 0 < ndim <= 8:
        return None
    local = SHAPE.unpack_from(view, HEADER.size + SHAPE.size)[:ndim]
    if offset + nbytes > view.nbytes or any(d < 0 for d in local):
        return None
    torch = _torch()
    dt = getattr(torch, _DTYPES[dtype])
    body = view[offset : offset + nbytes]
    if not nbytes:
        return torch.empty(local, dtype=dt)
    flat = torch.frombuffer(bytearray(body) if copy else body, dtype=torch.uint8)
    try:
        return flat.view(dt).reshape(local)
    except RuntimeError:
        return None


def shards(tensor: Any, tp_size: int, split_dim: int) -> list[bytes] | None:
    """The ``tp_size`` shard objects of ``tensor`` split evenly along ``split_dim``, or None
    where Mooncake refuses (an uneven split, a bad dim or size)."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor) or tp_size < 1:
        return None
    if not -tensor.dim() <= split_dim < tensor.dim():
        return None
    dim = split_dim % tensor.dim()
    if tensor.shape[dim] % tp_size:
        return None
    chunk = tensor.shape[dim] // tp_size
    parts = torch.split(tensor, chunk, dim=dim)
    glob = tuple(tensor.shape)
    return [encode(p, glob, (r, tp_size, dim, chunk)) for r, p in enumerate(parts)]


__all__ = ["META_SIZE", "decode", "encode", "shards"]
