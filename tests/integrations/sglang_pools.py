"""SGLang host pools for the integrations tests (SGLang's own MHA/MLA host pool code, see
kvflow/tools/bench/sglang_source.py) and seeded contents for them."""

from __future__ import annotations

from typing import Any

import torch

from kvflow.tools.bench.sglang_source import host_pool


def make_pool(kind: str, layout: str, pages: int = 16, page_size: int = 4) -> Any:
    """A small real SGLang host pool of ``pages`` pages: kind "mha" or "mla"."""
    return host_pool(kind, layout, pages=pages, page_size=page_size)


def fill(pool: Any, seed: int) -> None:
    """Seeded random contents (reproducible in another process)."""
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.dtype))


def page(pool: Any, number: int) -> torch.Tensor:
    """A copy of pool page ``number``'s flat data page (SGLang's get_data_page)."""
    return pool.get_data_page(number * pool.page_size).clone()


def slots(page: int, page_size: int) -> torch.Tensor:
    """The host indices of pool page ``page``."""
    return torch.arange(page * page_size, (page + 1) * page_size, dtype=torch.int64)


def indices(pages: list[int], page_size: int) -> torch.Tensor:
    return (
        torch.cat([slots(p, page_size) for p in pages])
        if pages
        else torch.empty(0, dtype=torch.int64)
    )
