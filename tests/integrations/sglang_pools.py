"""Host KV pools laid out like SGLang's (sglang/srt/mem_cache/pool_host/mha.py and mla.py,
0.5.23): the same ``kv_buffer`` shapes per layout and the same ``get_page_buffer_meta``
pointer arithmetic, without SGLang's device pools and kernels (which need CUDA/triton)."""

from __future__ import annotations

import torch


class MHAHostPool:
    """MHATokenToKVPoolHost's buffer: layer_first (2, L, size, H, D), page_first
    (2, size, L, H, D)."""

    is_mla = False

    def __init__(
        self, layout: str, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int
    ) -> None:
        self.layout, self.size, self.page_size = layout, size, page_size
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        self.dtype = torch.bfloat16
        if layout == "layer_first":
            dims = (2, layer_num, size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, size, layer_num, head_num, head_dim)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def get_data_page(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + self.page_size].clone()
        return self.kv_buffer[:, index : index + self.page_size].clone()

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        ptrs: list[int] = []
        base = self.kv_buffer.data_ptr()
        idx = indices.tolist()
        item = self.dtype.itemsize
        hd = self.head_num * self.head_dim * item
        v_offset = self.layer_num * self.size * hd
        if self.layout == "layer_first":
            for i in range(0, len(idx), self.page_size):
                for layer in range(self.layer_num):
                    k = base + idx[i] * hd + layer * self.size * hd
                    ptrs += [k, k + v_offset]
            size = item * self.page_size * self.head_num * self.head_dim
        else:
            for i in range(0, len(idx), self.page_size):
                k = base + idx[i] * self.layer_num * hd
                ptrs += [k, k + v_offset]
            size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)


class MLAHostPool:
    """MLATokenToKVPoolHost's buffer: layer_first (L, size, 1, kv_cache_dim), page_first
    (size, L, 1, kv_cache_dim)."""

    is_mla = True

    def __init__(
        self, layout: str, size: int, page_size: int, layer_num: int, kv_cache_dim: int
    ) -> None:
        self.layout, self.size, self.page_size = layout, size, page_size
        self.layer_num, self.kv_cache_dim = layer_num, kv_cache_dim
        self.dtype = torch.bfloat16
        if layout == "layer_first":
            dims = (layer_num, size, 1, kv_cache_dim)
        elif layout == "page_first":
            dims = (size, layer_num, 1, kv_cache_dim)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def get_data_page(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, index : index + self.page_size].clone()
        return self.kv_buffer[index : index + self.page_size].clone()

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        ptrs: list[int] = []
        base = self.kv_buffer.data_ptr()
        item = self.dtype.itemsize
        row = self.kv_cache_dim * item
        starts = indices.tolist()[:: self.page_size]
        if self.layout == "layer_first":
            for index in starts:
                ptrs += [
                    base + index * row + layer * self.size * row for layer in range(self.layer_num)
                ]
            size = item * self.page_size * self.kv_cache_dim
        else:
            ptrs = [base + index * self.layer_num * row for index in starts]
            size = self.layer_num * item * self.page_size * self.kv_cache_dim
        return ptrs, [size] * len(ptrs)


def make_pool(kind: str, layout: str, pages: int = 16, page_size: int = 4):
    """A small pool of ``pages`` pages: kind "mha" or "mla"."""
    if kind == "mha":
        return MHAHostPool(
            layout, pages * page_size, page_size, layer_num=3, head_num=2, head_dim=8
        )
    return MLAHostPool(layout, pages * page_size, page_size, layer_num=3, kv_cache_dim=24)


def fill(pool, seed: int) -> None:
    """Seeded random contents (reproducible in another process)."""
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.dtype))


def slots(page: int, page_size: int) -> torch.Tensor:
    """The host indices of pool page ``page``."""
    return torch.arange(page * page_size, (page + 1) * page_size, dtype=torch.int64)


def indices(pages: list[int], page_size: int) -> torch.Tensor:
    return (
        torch.cat([slots(p, page_size) for p in pages])
        if pages
        else torch.empty(0, dtype=torch.int64)
    )
