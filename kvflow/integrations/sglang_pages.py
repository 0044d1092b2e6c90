"""PageGeometry: how SGLang's host KV pool cuts one page into kvdb values, and their keys.

SGLang's host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) say where a page's
bytes are with ``get_page_buffer_meta(host_indices) -> (pointers, sizes)``: per page one
contiguous segment per (K, V) in ``page_first`` MHA, per (layer, K/V) in ``layer_first`` MHA,
one per page in ``page_first`` MLA and per layer in ``layer_first`` MLA. kvflow stores each
segment as one value under ``named_key(namespace, page hash, segment)``, so a page moves with
no gather or staging copy: the shard copies a segment straight between its DRAM pool and a
view of the host pool, and a remote read lands straight in the (registered) host pool.

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


@dataclass(frozen=True)
class PageGeometry:
    """Segments per page and their size, for one host pool (see the module doc)."""

    page_size: int
    segments: int
    segment_bytes: int
    layout: str

    @classmethod
    def of_pool(cls, pool: Any) -> PageGeometry:
        """Probe ``pool.get_page_buffer_meta`` with one page. Raises ValueError if its
        segments differ in size (a layout kvflow does not store)."""
        import torch

        page_size = int(pool.page_size)
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        flat_sizes = _flatten(sizes)
        if not flat_sizes or len(set(flat_sizes)) != 1 or len(_flatten(ptrs)) != len(flat_sizes):
            raise ValueError(f"host pool layout {pool.layout!r}: unequal or no page segments")
        return cls(page_size, len(flat_sizes), flat_sizes[0], str(pool.layout))

    def page_bytes(self) -> int:
        return self.segments * self.segment_bytes


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


__all__ = ["PageGeometry", "PageKeys", "PoolViews", "pool_namespace"]
