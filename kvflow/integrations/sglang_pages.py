"""PageGeometry: how SGLang's host KV pool cuts one page into kvdb values, and their keys.

SGLang's host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) say where a page's
bytes are with ``get_page_buffer_meta(host_indices) -> (pointers, sizes)``: per page one
contiguous segment per (K, V) in MHA ``page_first``/``page_first_direct``/``page_head``, per
(layer, K/V) in MHA ``layer_first``, one per page in MLA ``page_first``/``page_first_direct``
and per layer in MLA ``layer_first``. kvflow stores each segment as one value under
``named_key(namespace, page hash, segment)``, so a page moves with no gather or staging copy
(SGLang's zero-copy ``batch_get_v1``/``batch_set_v1``): the shard copies a segment straight
between its DRAM pool and a view of the host pool, and a remote read lands straight in the
(registered) host pool.

SGLang's generic path (``get``/``set`` of one page as ``get_data_page(flat=True)``, written
back with ``set_from_flat_data_page``) holds the same segments in another order where the
layout interleaves them (MHA ``layer_first``: all K layers, then all V layers, where the
pointers go K0 V0 K1 V1 ...). ``FlatPageOrder`` is derived once from the pool's own
``get_data_page`` view and ``get_page_buffer_meta`` pointers, so a page written on one path
reads back bit-exact on the other; a layout whose flat page is not made of whole segments has
no order and its generic calls are refused.

The namespace holds the tenant, SGLang's model name, the attention kind (MHA/MLA), the pool
layout, the page's segment geometry and (MHA) the tensor-parallel rank: two models, layouts,
tenants or TP shards never share or probe each other's pages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.kvdb import KVLayout, Namespace
from kvflow.kvdb.keys import DTYPE_SIZES, named_key

_UNSAFE = re.compile(r"[^A-Za-z0-9_.:/+=-]")


SUPPORTED_LAYOUTS = (
    "MHA layer_first, page_first, page_first_direct, page_head; "
    "MLA layer_first, page_first, page_first_direct"
)


@dataclass(frozen=True)
class PageGeometry:
    """Segments per page and their size, for one host pool (see the module doc)."""

    page_size: int
    segments: int
    segment_bytes: int
    layout: str

    @classmethod
    def of_pool(cls, pool: Any) -> PageGeometry:
        """Probe ``pool.get_page_buffer_meta`` with one page. Raises ValueError naming the
        layout if SGLang gives no pointers for it (e.g. ``page_unified``), if the segments
        differ in size (``page_first_kv_split``, MHA with a V width unlike K's) or if the pool
        splits pages across decode-context-parallel ranks."""
        import torch

        layout = str(getattr(pool, "layout", "?"))
        kind = type(pool).__name__
        if int(getattr(pool, "dcp_size", 1)) > 1:
            raise ValueError(
                f"kvflow HiCache storage: {kind} layout {layout!r} with dcp_size="
                f"{pool.dcp_size}: decode-context-parallel host pools are not supported"
            )
        page_size = int(pool.page_size)
        try:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        except (ValueError, NotImplementedError, AssertionError) as exc:
            raise ValueError(
                f"kvflow HiCache storage: {kind} layout {layout!r} is not supported: SGLang "
                f"gives no page segments for it ({exc}); supported: {SUPPORTED_LAYOUTS}"
            ) from exc
        flat_sizes = _flatten(sizes)
        if not flat_sizes or len(set(flat_sizes)) != 1 or len(_flatten(ptrs)) != len(flat_sizes):
            raise ValueError(
                f"kvflow HiCache storage: {kind} layout {layout!r} is not supported: its page "
                f"segments are {sorted(set(flat_sizes))} bytes (kvflow stores equal segments); "
                f"supported: {SUPPORTED_LAYOUTS}"
            )
        return cls(page_size, len(flat_sizes), flat_sizes[0], layout)

    def page_bytes(self) -> int:
        return self.segments * self.segment_bytes


@dataclass(frozen=True)
class FlatPageOrder:
    """Where each segment sits in SGLang's flat data page: ``chunks[i]`` is the index (in
    ``get_page_buffer_meta`` order) of the segment held by the flat page's i-th
    ``segment_bytes`` chunk."""

    chunks: tuple[int, ...]

    @classmethod
    def of_pool(cls, pool: Any, geometry: PageGeometry) -> FlatPageOrder | None:
        """Derive the order from the byte addresses of ``pool.get_data_page(0, flat=False)``
        (a view of ``kv_buffer``) against ``get_page_buffer_meta`` for the same page. None if
        the pool has no flat page for its layout, the view is a copy, or a chunk is not one
        whole segment."""
        import torch

        try:
            view = pool.get_data_page(0, flat=False)
        except (ValueError, NotImplementedError, TypeError):
            return None
        buffer = pool.kv_buffer
        if (
            view.device.type != "cpu"
            or view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        ):
            return None
        item = view.element_size()
        seg_bytes = geometry.segment_bytes
        if seg_bytes % item or view.numel() * item != geometry.page_bytes():
            return None
        addresses = torch.zeros((), dtype=torch.int64)
        for dim, (size, stride) in enumerate(zip(view.shape, view.stride(), strict=True)):
            shape = [1] * view.dim()
            shape[dim] = size
            addresses = addresses + (torch.arange(size, dtype=torch.int64) * stride).view(shape)
        flat = (addresses.reshape(-1) * item + view.data_ptr()).numpy()
        ptrs, _ = pool.get_page_buffer_meta(torch.arange(geometry.page_size, dtype=torch.int64))
        where = {ptr: i for i, ptr in enumerate(_flatten(ptrs))}
        per = seg_bytes // item
        step = np.arange(per, dtype=np.int64) * item
        chunks = []
        for c in range(geometry.segments):
            run = flat[c * per : (c + 1) * per]
            seg = where.get(int(run[0]))
            if seg is None or not np.array_equal(run - run[0], step):
                return None
            chunks.append(seg)
        if sorted(chunks) != list(range(geometry.segments)):
            return None
        return cls(tuple(chunks))


def _flatten(values: Any) -> list[int]:
    out: list[int] = []
    for v in values:
        out.extend(_flatten(v) if isinstance(v, list | tuple) else [int(v)])
    return out


def pool_namespace(
    pool: Any, geometry: PageGeometry, storage_config: Any, tenant: str, model: str | None
) -> Namespace:
    """The key namespace of this SGLang rank's pages. ``model`` overrides the model name
    (``kvflow_model`` in the extra config), e.g. to pin a fingerprint with weights identity."""
    is_mla = bool(storage_config.is_mla_model)
    dtype = str(pool.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:
        dtype = "uint8"  # an exotic KV dtype: the byte count is in the fingerprint anyway
    name = _UNSAFE.sub("_", model or storage_config.model_name or "unnamed")
    parts = [
        "sglang",
        name[:120],
        "mla" if is_mla else "mha",
        geometry.layout,
        f"{geometry.segments}x{geometry.segment_bytes}",
    ]
    if not is_mla and storage_config.tp_size > 1:
        parts.append(f"tp{storage_config.tp_rank}of{storage_config.tp_size}")
    if storage_config.pp_size > 1:
        parts.append(f"pp{storage_config.pp_rank}of{storage_config.pp_size}")
    if storage_config.attn_cp_size > 1:
        parts.append(f"cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}")
    layer_num = int(getattr(pool, "layer_num", 1))
    heads = 1 if is_mla else int(getattr(pool, "head_num", 1))
    head_dim = int(getattr(pool, "kv_cache_dim" if is_mla else "head_dim", 1))
    layout = KVLayout(layer_num, heads, head_dim, geometry.page_size, dtype)
    return Namespace(tenant, ":".join(parts), layout)


class PageKeys:
    """Segment keys of SGLang page hashes inside one namespace (pure, thread-safe)."""

    def __init__(self, namespace: Namespace, geometry: PageGeometry) -> None:
        self.namespace = namespace
        self.geometry = geometry

    def of(self, page: str) -> list[bytes]:
        """The keys of ``page``'s segments, in ``get_page_buffer_meta`` order."""
        name = page.encode("utf-8")
        return [named_key(self.namespace, name, s) for s in range(self.geometry.segments)]

    def flat(self, pages: list[str]) -> list[bytes]:
        return [k for page in pages for k in self.of(page)]


class PoolViews:
    """Zero-copy uint8 views of segments of one host pool's ``kv_buffer``."""

    def __init__(self, pool: Any, geometry: PageGeometry) -> None:
        import torch

        buffer = pool.kv_buffer
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("host pool kv_buffer must be a contiguous CPU tensor")
        self.pool = pool
        self.geometry = geometry
        self.bytes: np.ndarray = buffer.reshape(-1).view(torch.uint8).numpy()
        self._base = int(buffer.data_ptr())

    def segments(self, host_indices: Any) -> list[np.ndarray]:
        """One view per segment of the pages at ``host_indices`` (page_size token slots per
        page), in page order. Raises ValueError if the pool points outside its buffer."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        views = []
        limit = self.bytes.shape[0]
        for ptr, size in zip(_flatten(ptrs), _flatten(sizes), strict=True):
            start = ptr - self._base
            if start < 0 or start + size > limit:
                raise ValueError(f"host_indices: segment at offset {start} outside the pool")
            views.append(self.bytes[start : start + size])
        return views


__all__ = [
    "SUPPORTED_LAYOUTS",
    "FlatPageOrder",
    "PageGeometry",
    "PageKeys",
    "PoolViews",
    "pool_namespace",
]
