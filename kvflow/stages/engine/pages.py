"""The KV page pool: one preallocated tensor and a free list.

The pool tensor is laid out [num_pages, layers, 2 (k, v), kv_heads, block_size, head_dim].
Page p is `tensor[p]`: one contiguous buffer, so it exports to bytes and imports from bytes
without a gather, and one layer of it (`tensor[p, l]`) is a contiguous slice.

Not thread-safe: the engine thread owns the pool.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvflow.stages.engine.errors import OutOfPagesError, PageLayoutError
from kvflow.transfer.pool_memory import pool_bytes, write_zeros

PageData = bytes | bytearray | memoryview | torch.Tensor

_CPU = torch.device("cpu")


TRANSFER_BYTES = 64 << 20
"""The most bytes of imported pages one host-to-device copy takes (`PagePool.check_pages`):
the size of the pinned buffer they cross through."""

RESIDENT_TOKENS = 4096
"""A lazily mapped pool writes, at start-up, the pages one sequence of this many tokens
(at most the model's length) needs: the first request takes no page faults."""


def resident_pages(num_pages: int, block_size: int, max_model_len: int) -> int:
    """The leading pages of a pool of ``num_pages`` that start resident: those one sequence
    of ``min(max_model_len, RESIDENT_TOKENS)`` tokens needs (the free lists are LIFO, so the
    first requests use these and later ones reuse them)."""
    return min(num_pages, -(-min(max_model_len, RESIDENT_TOKENS) // block_size))


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, resident: int = 0
) -> torch.Tensor:
    """A zero tensor whose memory is taken as it is written. On the CPU it is pool memory
    (`kvflow.transfer.pool_memory`: an anonymous mapping of small pages that the kernel maps
    on first write), so a pool sized for many sequences costs resident memory only for the
    pages used so far (torch.zeros writes every byte at once). The first ``resident`` entries
    along dimension 0 are written here, so their page faults are taken at start-up rather than
    by the first request that uses them. Other devices: torch.zeros."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize
    for n in shape:
        nbytes *= n
    raw = torch.from_numpy(pool_bytes(nbytes))
    tensor = raw.view(dtype).view(shape)
    if resident > 0:  # a write maps the pages; their bytes stay zero
        write_zeros(raw.numpy()[: resident * (nbytes // shape[0])])
    return tensor


def _check_finite(index: int, page: torch.Tensor) -> None:
    """PageLayoutError unless every value of page ``index`` is finite."""
    if not bool(torch.isfinite(page).all()):
        raise PageLayoutError(f"page {index}: holds non-finite values")


@dataclass(frozen=True)
class KVLayout:
    """The shape of one KV page; two caches are compatible only if their layouts are equal."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)


class PagePool:
    """Fixed pool of KV pages. Allocation takes the front of the free list, where freed pages
    return (last in, first out), so the page ids a sequence of calls returns are
    deterministic and recently used (resident) pages are reused first."""

    def __init__(
        self,
        num_pages: int,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device,
        resident: int = 0,
        spare: int = 0,
    ) -> None:
        """``resident``: leading pages mapped now (`lazy_zeros`; on another device, of the
        host mirror); allocation takes them first.
        ``spare``: pages after the ``num_pages`` allocatable ones that are never allocated
        (ids ``num_pages`` ..): the decode graphs' padding rows write their K/V there
        (decode_graphs.py), where no request reads."""
        self.layout = layout
        self.dtype = dtype
        shape = (num_pages + spare, *layout.page_shape)
        self.tensor = lazy_zeros(shape, dtype, device, resident)
        # Where `export` puts pages: the pool itself on the CPU; for a pool on another device
        # (a GPU) a mirror of it in host memory, mapped as it is written (`lazy_zeros`).
        self.host = (
            self.tensor if device.type == "cpu" else lazy_zeros(shape, dtype, _CPU, resident)
        )
        self._num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs: dict[int, int] = {}  # allocated page -> holders (requests sharing it)

    @property
    def num_pages(self) -> int:
        """Allocatable pages (the tensor may hold spare pages after them)."""
        return self._num_pages

    def spare_page(self, index: int = 0) -> int:
        """The id of spare page ``index`` (IndexError if the pool has no such page)."""
        page = self._num_pages + index
        if not (index >= 0 and page < self.tensor.shape[0]):
            raise IndexError(f"the pool has {self.tensor.shape[0] - self._num_pages} spare pages")
        return page

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def page_nbytes(self) -> int:
        return int(self.tensor[0].numel() * self.tensor.element_size())

    def allocate(self, n: int) -> list[int]:
        """Take n free pages; raises OutOfPagesError (and takes none) if fewer are free."""
        if n > len(self._free):
            raise OutOfPagesError(n, len(self._free))
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, page_id: int) -> None:
        """One more holder of an allocated page (a request reading a block another computed
        or imported); the page returns to the pool when its last holder frees it."""
        if page_id not in self._refs:
            raise ValueError(f"page {page_id} is not allocated")
        self._refs[page_id] += 1

    def holders(self, page_id: int) -> int:
        """How many holders an allocated page has (0: free)."""
        return self._refs.get(page_id, 0)

    def free(self, pages: Iterable[int]) -> list[int]:
        """Drop one holder of each page; pages without holders return to the pool (returned,
        in order). Their contents are left as they are (not zeroed).

        Freed pages go to the front of the free list, so the next allocation reuses them: the
        pool's memory is mapped lazily (`lazy_zeros`), and pages already written cost no page
        faults, so a steady load keeps touching the pages it has made resident."""
        dropped = list(pages)
        counts: dict[int, int] = {}
        for p in dropped:
            counts[p] = counts.get(p, 0) + 1
            if counts[p] > self._refs.get(p, 0):
                raise ValueError(f"page {p} is not allocated")  # and none is returned
        returned = []
        for p in dropped:
            self._refs[p] -= 1
            if not self._refs[p]:
                del self._refs[p]
                returned.append(p)
        self._free.extendleft(reversed(returned))
        return returned

    def page(self, page_id: int) -> torch.Tensor:
        """A view of one page (contiguous); valid while the page stays allocated."""
        return self.tensor[page_id]

    def export(self, page_ids: Sequence[int]) -> list[torch.Tensor]:
        """Views of pages ``page_ids`` in host memory (`host`), valid while the pages stay
        allocated: the pool's own pages on the CPU (no copy); for a pool on another device,
        the pages are copied into the mirror's pages of the same ids first (one gather and one
        device-to-host copy, which waits for the device)."""
        if not page_ids:
            return []
        if self.host is not self.tensor:
            ids = torch.tensor(page_ids, dtype=torch.long)
            self.host[ids] = self.tensor.index_select(0, ids.to(self.tensor.device)).cpu()
        return [self.host[p] for p in page_ids]

    def page_bytes(self, page_id: int) -> bytes:
        """A copy of one page's raw bytes in the pool dtype."""
        page = self.tensor[page_id].detach().cpu()
        return page.reshape(-1).view(torch.uint8).numpy().tobytes()

    def check_pages(self, pages: Sequence[PageData], verify: bool = True) -> list[torch.Tensor]:
        """`check_page` of each page: every page's layout first, then (``verify``) every
        page's values, so the error names the first bad page by index on any device. For a
        pool on another device (a GPU) the pages cross in transfers of up to
        ``TRANSFER_BYTES`` through one pinned host buffer and their values are scanned on the
        device, with one wait for all of them: page by page from pageable memory, the driver
        bounced every page through its own buffer and each scan waited for the device
        (122 pages of the demo model on an H200: 28-51 ms, against 8-12 ms)."""
        host = [self._host_view(i, p) for i, p in enumerate(pages)]
        if self.tensor.device.type == "cpu" or not host:
            if verify:
                for i, page in enumerate(host):
                    _check_finite(i, page)
            return host
        out = self._to_device(host)
        if verify:
            finite = torch.cat([torch.isfinite(p).flatten(1).all(1) for p in out]).tolist()
            if not all(finite):
                raise PageLayoutError(f"page {finite.index(False)}: holds non-finite values")
        return [page for batch in out for page in batch.unbind(0)]

    def _to_device(self, host: list[torch.Tensor]) -> list[torch.Tensor]:
        """Checked host views (or tensors already elsewhere) on the pool's device, in
        batches [n, *page_shape] of at most ``TRANSFER_BYTES``."""
        device = self.tensor.device
        if any(h.device.type != "cpu" for h in host):
            return [torch.stack([h.to(device) for h in host])]
        per_batch = max(1, TRANSFER_BYTES // self.page_nbytes)
        staging = torch.empty(
            (min(per_batch, len(host)), *self.layout.page_shape), dtype=self.dtype, pin_memory=True
        )  # torch's pinned-memory cache keeps this block for the next import
        out = []
        for lo in range(0, len(host), per_batch):
            part = host[lo : lo + per_batch]
            torch.stack(part, out=staging[: len(part)])
            out.append(staging[: len(part)].to(device))  # a blocking copy: staging is reused
        return out

    def check_page(self, index: int, data: PageData, verify: bool = True) -> torch.Tensor:
        """Validate one page to import and return a read-only view of it as a tensor of page
        shape and pool dtype (no copy unless it lives on another device). ``verify`` also
        rejects non-finite values (one pass over the page); callers whose pages are
        checksummed copies of pages an engine computed may skip it. Raises PageLayoutError
        naming the mismatch."""
        page = self._host_view(index, data).to(self.tensor.device)
        if verify:
            _check_finite(index, page)
        return page

    def _host_view(self, index: int, data: PageData) -> torch.Tensor:
        """A view of one page as a tensor of page shape and pool dtype where it lives (no
        copy); PageLayoutError naming the mismatch."""
        shape = self.layout.page_shape
        if isinstance(data, torch.Tensor):
            if tuple(data.shape) != shape:
                raise PageLayoutError(f"page {index}: shape {tuple(data.shape)} != {shape}")
            if data.dtype != self.dtype:
                raise PageLayoutError(f"page {index}: dtype {data.dtype} != {self.dtype}")
            return data
        try:
            raw = memoryview(data).cast("B")
        except TypeError as exc:
            raise PageLayoutError(f"page {index}: not a contiguous buffer: {exc}") from exc
        if raw.nbytes != self.page_nbytes:
            raise PageLayoutError(
                f"page {index}: {raw.nbytes} bytes, a page of layout {shape} "
                f"{self.layout.dtype} has {self.page_nbytes}"
            )
        with warnings.catch_warnings():  # read-only buffers are fine: we only read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
        return flat.view(self.dtype).view(shape)

    def write_pages(self, page_ids: Sequence[int], pages: Sequence[torch.Tensor]) -> None:
        """Copy already-checked pages (from `check_page`) into the pool: the only copy."""
        for pid, page in zip(page_ids, pages, strict=True):
            self.tensor[pid].copy_(page)
