"""KV attention backends: where a layer's K/V is stored and which context a token attends to.

- `PagedPrefill`: one request's chunk of consecutive tokens; K/V written into its pages,
  attention over all its tokens so far (the chunk's offset gives the causal mask). With a
  float32 pool on the CPU and no window that hides earlier tokens
  (`cpu_attn.paged_kernel`), the chunk attends in place through its page list
  (cpu_prefill.c: no gather, tiles of queries by keys, masked only on the diagonal).
  Otherwise on the CPU (`blocked_causal`) the chunk's queries go in blocks of
  `QUERY_BLOCK` rows, each attending in two parts merged by their log-sum-exp: the tokens
  before the block (every one visible: no mask) and the block's own (causal). torch's CPU
  flash kernel splits keys in blocks of 512, so a 512-token causal attention computed every
  masked score; in blocks the masked half is skipped (docs/performance.md). Elsewhere (a
  GPU), without a sliding window: one attention with torch's lower-right causal bias
  (`causal_lower_right`), which its flash and memory-efficient kernels take as it is
  instead of a materialized mask; with a window: one attention under a materialized mask.
- `PagedDecode`: one token for each of several requests. With a float32 pool on the CPU
  (`cpu_attn.paged_kernel`) every request attends in place through its own page list
  (cpu_attn.c: no gather, no mask). Otherwise (another dtype or device, `KVFLOW_ATTN=torch`)
  each request's pages are gathered into a padded batch and masked by its own length. When
  every request of the batch starts with the same pages (a prefix the engine shares by
  key), those are attended once for all of the batch's queries (one flash attention whose
  rows are every request's query heads of a KV head) and merged with each request's own
  part by log-sum-exp ("cascade" attention): the shared K/V is read once a layer instead of
  once a request.
- `PaddedDecode`: a decode batch in fixed shapes (every row over the same number of pages,
  masked by its position), computed from device tensors alone: what the CUDA graphs of
  decode_graphs.py capture and replay.
- `ContiguousKV`: the plain reference path: one sequence, one contiguous K/V per layer.

All but the paged kernel use `scaled_dot_product_attention` with grouped-query attention
(`enable_gqa`); all take an optional sliding window (Mistral): key j is visible to query i
iff i - window < j <= i.
Each backend is built for one forward pass and is not thread-safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from kvflow.stages.engine.cpu_attn import PREFILL_GROUP_MAX, PagedKernel, paged_kernel
from kvflow.stages.engine.pages import PagePool


def visible_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean mask [..., Tq, Tk]: True where key position k_pos may be attended from q_pos.
    q_pos [..., Tq, 1] and k_pos [..., 1, Tk] broadcast."""
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask


GPU_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The attention kernels a CUDA device may pick, in order: every one but cuDNN's, which builds
a plan for each new key length. Every decode step is a new length: on an H200 with bf16 the
cuDNN call took 4.8 ms of CPU a layer (decode at batch 1: 23 tokens/s; BENCHMARKS.md)."""


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | CausalBias | None,
    causal: bool = False,
) -> torch.Tensor:
    gqa = q.shape[-3] != k.shape[-3]
    if q.device.type == "cuda":
        with sdpa_kernel(GPU_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
            )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def gather_context(pool: torch.Tensor, layer: int, page_ids: torch.Tensor) -> torch.Tensor:
    """K/V of `layer` over the pages `page_ids` ([pages] or [B, pages]) as
    [2, (B,) kv_heads, pages * block_size, head_dim]: one copy (the gather), the rest views.

    Selecting the pages of a per-layer view that already has (k/v, head) in front gives
    [2, heads, (B,) pages, block, d], where pages and block are adjacent and merge freely;
    gathering whole pages first and permuting after would copy the context twice.
    `index_select` copies each page's contiguous [block, d] run at once: 3.4x faster than
    advanced indexing (`per_layer[:, :, page_ids]`) for 31 pages of SmolLM2-135M."""
    per_layer = pool[:, layer].permute(1, 2, 0, 3, 4)  # [2, kvh, pool pages, bs, d], a view
    ctx = per_layer.index_select(2, page_ids.reshape(-1))  # [2, kvh, (B *) n, bs, d]
    if page_ids.dim() == 2:
        ctx = ctx.unflatten(2, tuple(page_ids.shape)).permute(0, 2, 1, 3, 4, 5)
    return ctx.flatten(-3, -2)  # [2, (B,) kvh, n * bs, d]


def attend_pages(
    pool: torch.Tensor, layer: int, qg: torch.Tensor, table: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Rows qg [n, kvh, group, d] (a KV head's query heads as its rows) over their pages
    `table` [n, pages] of `layer`, gathered, under `mask` [n, 1, 1, pages * bs] (boolean or
    additive) -> [n, kvh, group, d]."""
    ctx = gather_context(pool, layer, table)  # [2, n, kvh, pages * bs, d]
    return _sdpa(qg, ctx[0], ctx[1], mask)


_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

QUERY_BLOCK = 128
"""Query rows per block of `blocked_causal` (64-256 measured within a few % of each other)."""


def parts_apply(device: torch.device, window: int | None, end: int) -> bool:
    """Whether a chunk ending at `end` attends by `blocked_causal`: on the CPU where torch has
    the flash kernel that returns the log-sum-exp, without a sliding window that hides
    earlier tokens."""
    return device.type == "cpu" and _flash_cpu is not None and (window is None or window >= end)


def attend_in_parts(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prior_k: torch.Tensor, prior_v: torch.Tensor
) -> torch.Tensor:
    """Causal attention of a block of consecutive queries over earlier keys and its own.

    q [heads, T, d]; k/v [kv_heads, T, d] (the block's own); prior_k/prior_v
    [kv_heads, S, d] (every earlier position, all visible) -> [heads, T, d]. Each part is one
    flash attention that also returns its log-sum-exp L; the parts merge exactly:
    out = (o1 e^{L1} + o2 e^{L2}) / (e^{L1} + e^{L2}). Grouped-query heads: for the prior
    part the queries of the heads sharing a KV head are stacked as that head's rows (no mask,
    so the rows are independent); the own part repeats K/V (T rows, causal)."""
    assert _flash_cpu is not None
    heads, t, d = q.shape
    kvh = k.shape[0]
    group = heads // kvh
    qf = q.reshape(1, kvh, group * t, d)
    o1, l1 = _flash_cpu(qf, prior_k.unsqueeze(0), prior_v.unsqueeze(0))[:2]
    o1, l1 = o1.reshape(heads, t, d), l1.reshape(heads, t)
    if group > 1:
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    o2, l2 = _flash_cpu(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True)[:2]
    o2, l2 = o2.reshape(heads, t, d), l2.reshape(heads, t)
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top).unsqueeze(-1), torch.exp(l2 - top).unsqueeze(-1)
    # L is float32 whatever q's dtype: merge in float32, answer in q's dtype (bf16 stays bf16)
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)


def blocked_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, block: int = QUERY_BLOCK
) -> torch.Tensor:
    """Causal attention of the queries at positions [start, start + T) over keys [0, start + T).

    q [heads, T, d]; k/v [kv_heads, start + T, d] -> [heads, T, d]. The queries go in blocks
    of `block`: the first block of a prompt (nothing before it) by one causal attention, the
    others by `attend_in_parts`."""
    t = q.shape[1]
    outs = []
    for lo in range(0, t, block):
        hi = min(lo + block, t)
        a, b = start + lo, start + hi  # the block's positions
        qb, kb, vb = q[:, lo:hi], k[:, a:b], v[:, a:b]
        if a == 0:
            first = _sdpa(qb.unsqueeze(0), kb.unsqueeze(0), vb.unsqueeze(0), None, causal=True)
            outs.append(first.squeeze(0))
        else:
            outs.append(attend_in_parts(qb, kb, vb, k[:, :a], v[:, :a]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def check_page_ids(page_ids: torch.Tensor, num_pages: int) -> None:
    """IndexError unless every id is a page of a pool of ``num_pages`` (what torch's
    indexing raised before the kernels read and wrote through the ids unchecked)."""
    if page_ids.numel() and not (int(page_ids.min()) >= 0 and int(page_ids.max()) < num_pages):
        raise IndexError(f"page ids {page_ids.tolist()} out of range for {num_pages} pages")


class PagedPrefill:
    """Chunk [start, start + T) of one request whose pages are `page_ids` (in block order).

    `page_ids` must cover position start + T - 1. `attend` writes the chunk's K/V into the
    pool, then attends over positions [0, start + T) (with the CPU kernel: both in one call
    a layer)."""

    def __init__(
        self,
        pool: PagePool,
        page_ids: torch.Tensor,
        start: int,
        num_tokens: int,
        window: int | None,
    ) -> None:
        device = pool.tensor.device
        bs = pool.layout.block_size
        self.pool, self.start, self.num_tokens = pool, start, num_tokens
        end = start + num_tokens
        positions = torch.arange(start, end, device=device)
        self.slot_pages = page_ids[positions // bs]
        self.slot_offsets = positions % bs
        self.ctx_pages = page_ids[: (end + bs - 1) // bs]
        self.ctx_len = end
        # A float32 pool on the CPU without a window that hides earlier tokens: the chunk
        # attends in place through its page list (cpu_prefill.c; no gather, no blocks).
        self.kernel: PagedKernel | None = None
        if window is None or window >= end:
            self.kernel = paged_kernel(pool.tensor)
            self.kernel_pages = self.ctx_pages.to(torch.int64).contiguous()
            if self.kernel is not None:  # the kernel reads and writes through these ids
                check_page_ids(self.kernel_pages, pool.tensor.shape[0])
        # The first chunk without a window needs no gather: its own K/V are the context.
        self.fast = start == 0 and (window is None or window >= num_tokens)
        self.blocked = parts_apply(device, window, end)
        self.mask: torch.Tensor | CausalBias | None = None
        if not self.fast and not self.blocked:
            if window is None or window >= end:  # every earlier token visible: causal only
                self.mask = causal_lower_right(num_tokens, end)
            else:
                self.mask = visible_mask(
                    positions[:, None], torch.arange(end, device=device)[None, :], window
                )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool = self.pool.tensor
        if self.kernel is not None and q.shape[1] // k.shape[1] <= PREFILL_GROUP_MAX:
            # the kernel writes the chunk's K/V into its slots, then attends: one call
            out = self.kernel.prefill(pool, layer, self.kernel_pages, self.start, q, (k, v))
            return out.reshape(self.num_tokens, -1)
        pool[self.slot_pages, layer, :, :, self.slot_offsets] = torch.stack((k, v), dim=1)
        if self.blocked:
            if self.start == 0:  # the chunk's own K/V are the whole context: no gather
                ctx_k, ctx_v = k.transpose(0, 1), v.transpose(0, 1)
            else:
                ctx_k, ctx_v = gather_context(pool, layer, self.ctx_pages)[:, :, : self.ctx_len]
            out = blocked_causal(q.transpose(0, 1), ctx_k, ctx_v, self.start)
            return out.transpose(0, 1).reshape(self.num_tokens, -1)
        qh = q.transpose(0, 1).unsqueeze(0)
        if self.fast:
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            out = _sdpa(qh, kh, vh, None, causal=True)
        else:
            ctx = gather_context(pool, layer, self.ctx_pages)[:, :, : self.ctx_len]
            out = _sdpa(qh, ctx[0].unsqueeze(0), ctx[1].unsqueeze(0), self.mask)
        return out.squeeze(0).transpose(0, 1).reshape(self.num_tokens, -1)


class PagedDecode:
    """One new token for each of B requests. `page_table` [B, max_pages] lists each request's
    pages (padded with any valid page id); `positions` [B] is each new token's position.

    A float32 pool on the CPU: one call of the paged kernel a layer (cpu_attn.c), which
    writes the new K/V and attends every row over its own pages in place. Otherwise:
    requests that start with the same pages (shared by key, engine.py) form a group; each
    group's shared pages are attended once for all of its rows (`_cascade`), and only the
    rest of their pages is gathered row by row. Rows of no group attend as one batch.
    A batch of one request that sees all its tokens takes `_single` (no mask, no tables)."""

    def __init__(
        self,
        pool: PagePool,
        page_table: torch.Tensor,
        positions: torch.Tensor,
        window: int | None,
    ) -> None:
        bs = pool.layout.block_size
        dev = page_table.device
        self.pool, self.window = pool, window
        table, pos = page_table.tolist(), positions.tolist()
        # A float32 pool on the CPU: every row attends in place through its page list
        # (cpu_attn.c), which also writes the new K/V; no gather, no mask, no groups.
        self.kernel: PagedKernel | None = paged_kernel(pool.tensor)
        if self.kernel is not None:
            lows = [0 if window is None else max(0, p - window + 1) for p in pos]
            self.table = page_table.to(torch.int64).contiguous()
            self.ranges = torch.tensor([[lo, p + 1] for lo, p in zip(lows, pos, strict=True)])
            slots = [[row[p // bs], p % bs] for row, p in zip(table, pos, strict=True)]
            self.slots = torch.tensor(slots)
            return
        # One request whose every earlier token is visible (batch 1, no window that hides
        # any): its context is exactly its first pos + 1 slots, attended without a mask.
        self.single: tuple[int, int, int, torch.Tensor] | None = None
        if len(table) == 1 and (window is None or window > pos[0]):
            n = pos[0] // bs + 1
            self.single = table[0][n - 1], pos[0] % bs, pos[0] + 1, page_table[0, :n]
            return
        rows = torch.arange(page_table.shape[0], device=dev)
        self.slot_pages = page_table[rows, positions // bs]
        self.slot_offsets = positions % bs
        groups = shared_groups(table, pos, bs, window) if dev.type == "cpu" else []
        # each group: its rows (indices into the cascade rows) and its shared pages
        start = {r: n for members, n in groups for r in members}  # a row's first own page
        cascade = sorted(start)
        plain = [r for r in range(len(table)) if r not in start]
        self.cascade_rows = torch.tensor(cascade, dtype=torch.int64, device=dev)
        self.plain_rows = torch.tensor(plain, dtype=torch.int64, device=dev)
        index = {r: i for i, r in enumerate(cascade)}
        self.groups = [
            (torch.tensor([index[r] for r in members], device=dev), page_table[members[0], :n])
            for members, n in groups
        ]
        self.cascade = self._part(table, pos, cascade, [start.get(r, 0) for r in cascade], bs)
        self.plain = self._part(table, pos, plain, [0] * len(plain), bs)
        if self.cascade is not None:  # the flash kernel takes an additive mask
            ids, mask = self.cascade
            additive = torch.zeros(mask.shape, dtype=pool.dtype, device=dev)
            self.cascade = ids, additive.masked_fill(~mask, float("-inf"))

    def _part(
        self, table: list[list[int]], pos: list[int], rows: list[int], start: list[int], bs: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(page table, visibility mask [n, 1, 1, ctx]) of ``rows``, each from its page
        ``start``: only the pages up to a row's position, padded (masked) to one width."""
        if not rows:
            return None
        dev = self.pool.tensor.device
        ends = [pos[r] // bs + 1 for r in rows]
        width = max(e - s for e, s in zip(ends, start, strict=True))
        own = [
            table[r][s:e] + [table[r][0]] * (width - (e - s))
            for r, s, e in zip(rows, start, ends, strict=True)
        ]
        first = torch.tensor(start, device=dev)[:, None] * bs
        k_pos = first + torch.arange(width * bs, device=dev)
        q_pos = torch.tensor([pos[r] for r in rows], device=dev)[:, None]
        mask = visible_mask(q_pos, k_pos, self.window)
        return torch.tensor(own, dtype=torch.int64, device=dev), mask[:, None, None, :]

    def paged_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(pool, table, ranges, slots) where the paged kernel attends (cpu_decode.py runs the
        layers in one call then), else None."""
        if self.kernel is None:
            return None
        return self.pool.tensor, self.table, self.ranges, self.slots

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            new_kv = (k, v, self.slots)
            out = self.kernel.attend(self.pool.tensor, layer, self.table, self.ranges, q, new_kv)
            return out[0].reshape(q.shape[0], -1)
        if self.single is not None:
            return self._single(layer, q, k, v)
        pool = self.pool.tensor
        pool[self.slot_pages, layer, :, :, self.slot_offsets] = torch.stack((k, v), dim=1)
        b, kvh, d = q.shape[0], k.shape[1], q.shape[2]
        # Grouped-query attention without expanding K/V: the query heads that share a KV head
        # are that head's queries (head h reads KV head h // group, as in Hugging Face).
        qg = q.reshape(b, kvh, -1, d)  # [B, kvh, group, d]
        if self.cascade is None:
            assert self.plain is not None
            return self._plain(layer, qg, *self.plain).reshape(b, -1)
        if self.plain is None:
            return self._cascade(layer, qg, *self.cascade).reshape(b, -1)
        out = torch.empty_like(qg)
        out[self.cascade_rows] = self._cascade(layer, qg[self.cascade_rows], *self.cascade)
        out[self.plain_rows] = self._plain(layer, qg[self.plain_rows], *self.plain)
        return out.reshape(b, -1)

    def _single(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The one request of a batch of 1 over its first `length` slots: no mask, and no
        gather while they fit in one page (`pool[page, layer]` is [2, kvh, block, d], one
        contiguous slice). Per layer at 40-300 tokens of SmolLM2-135M this is 0.6-0.9x the
        time of the masked batch path (docs/performance.md)."""
        assert self.single is not None
        page, offset, length, pages = self.single
        pool = self.pool.tensor
        pool[page, layer, :, :, offset] = torch.stack((k[0], v[0]))
        if pages.shape[0] == 1:
            ctx = pool[page, layer, :, :, :length]  # [2, kvh, length, d], a view
        else:
            ctx = gather_context(pool, layer, pages)[:, :, :length]
        kvh, d = k.shape[1], q.shape[2]
        qg = q.reshape(1, kvh, -1, d)  # a KV head's query heads are its rows, as in `attend`
        return _sdpa(qg, ctx[0].unsqueeze(0), ctx[1].unsqueeze(0), None).reshape(1, -1)

    def _plain(
        self, layer: int, qg: torch.Tensor, table: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        return attend_pages(self.pool.tensor, layer, qg, table, mask)

    def _cascade(
        self, layer: int, qg: torch.Tensor, table: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Each row over its own pages; each group's rows over its shared pages in one flash
        attention (its rows' query heads of a KV head are that head's rows); the two parts
        merged by their log-sum-exp (as `attend_in_parts`). The shared K/V is read once a
        layer, not once a row. qg [n, kvh, group, d]: the rows of the groups."""
        assert _flash_cpu is not None
        _, kvh, group, d = qg.shape
        ctx = gather_context(self.pool.tensor, layer, table)  # the rows' own pages
        o2, l2 = _flash_cpu(qg, ctx[0], ctx[1], attn_mask=mask)[:2]
        o1 = torch.empty_like(o2)
        l1 = torch.empty_like(l2)
        for members, ids in self.groups:
            n = members.shape[0]
            shared = gather_context(self.pool.tensor, layer, ids)  # [2, kvh, S, d]
            qs = qg[members].transpose(0, 1).reshape(1, kvh, n * group, d)
            o, lse = _flash_cpu(qs, shared[0].unsqueeze(0), shared[1].unsqueeze(0))[:2]
            o1[members] = o.reshape(kvh, n, group, d).transpose(0, 1)
            l1[members] = lse.reshape(kvh, n, group).transpose(0, 1)
        top = torch.maximum(l1, l2)  # both finite: a row sees its own new token and the prefix
        w1, w2 = torch.exp(l1 - top).unsqueeze(-1), torch.exp(l2 - top).unsqueeze(-1)
        return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(qg.dtype)


class PaddedDecode:
    """A decode batch in fixed shapes, read from device tensors only: what a CUDA graph
    captures once and replays for every batch of its bucket (decode_graphs.py).

    ``table`` [B, W] lists each row's pages (padded with any valid page id) and ``positions``
    [B] each new token's position; their contents change between forwards, their shapes and
    storage never. `prepare` derives the write slots and the visibility mask from them on the
    device (no host read), so a captured forward sees each replay's values. Every row attends
    over all W pages under its mask (keys up to its position, within the window): one gather
    and one attention for the batch, whatever its lengths. A padding row (position 0 on a
    spare page) writes and reads only that page."""

    def __init__(
        self, pool: PagePool, table: torch.Tensor, positions: torch.Tensor, window: int | None
    ) -> None:
        self.pool, self.table, self.positions, self.window = pool, table, positions, window
        self.block_size = pool.layout.block_size
        self.key_positions = torch.arange(table.shape[1] * self.block_size, device=table.device)
        self.slot_pages = torch.empty_like(positions)
        self.slot_offsets = torch.empty_like(positions)
        # additive (0 / -inf) in the pool's dtype, made once a forward: a boolean mask is
        # turned into one by the attention of every layer
        self.mask = torch.empty(
            (table.shape[0], 1, 1, self.key_positions.shape[0]),
            dtype=pool.dtype,
            device=table.device,
        )

    def prepare(self) -> None:
        """Derive this forward's slots and mask from the current table and positions."""
        bs = self.block_size
        block = torch.div(self.positions, bs, rounding_mode="floor")
        self.slot_pages.copy_(self.table.gather(1, block[:, None]).squeeze(1))
        self.slot_offsets.copy_(self.positions - block * bs)
        visible = visible_mask(self.positions[:, None], self.key_positions[None, :], self.window)
        self.mask.zero_().masked_fill_(~visible[:, None, None, :], float("-inf"))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool = self.pool.tensor
        pool[self.slot_pages, layer, :, :, self.slot_offsets] = torch.stack((k, v), dim=1)
        b, kvh, d = q.shape[0], k.shape[1], q.shape[2]
        qg = q.reshape(b, kvh, -1, d)  # a KV head's query heads are its rows, as in PagedDecode
        return attend_pages(pool, layer, qg, self.table, self.mask).reshape(b, -1)


def shared_groups(
    table: list[list[int]], positions: list[int], block_size: int, window: int | None
) -> list[tuple[list[int], int]]:
    """The groups of a decode batch (rows, shared pages): two or more rows whose first pages
    are the same ids (a prefix shared by key, engine.py), each of those pages wholly visible
    to every row of the group. None without the CPU flash kernel; none where a sliding
    window may hide the group's first tokens."""
    if _flash_cpu is None:
        return []
    by_first: dict[int, list[int]] = {}
    for r, row in enumerate(table):
        by_first.setdefault(row[0], []).append(r)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        if window is not None and max(positions[r] for r in members) >= window:
            continue
        first = table[members[0]]
        n = min(positions[r] for r in members) // block_size  # full pages before every row's
        n = next((i for i in range(n) if any(table[r][i] != first[i] for r in members)), n)
        if n:
            groups.append((members, n))
    return groups


class ContiguousKV:
    """Plain reference KV cache for one sequence: K/V [layers][kv_heads, capacity, head_dim].

    Call `advance(start, T)` before each forward over tokens [start, start + T)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        window: int | None = None,
    ) -> None:
        shape = (num_layers, 2, num_kv_heads, capacity, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.window = window
        self.start = 0
        self.num_tokens = 0

    def advance(self, start: int, num_tokens: int) -> None:
        if start + num_tokens > self.kv.shape[3]:
            raise ValueError(f"ContiguousKV capacity {self.kv.shape[3]} exceeded")
        self.start, self.num_tokens = start, num_tokens

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, end = self.start, self.start + self.num_tokens
        self.kv[layer, 0, :, start:end] = k.transpose(0, 1)
        self.kv[layer, 1, :, start:end] = v.transpose(0, 1)
        qh = q.transpose(0, 1).unsqueeze(0)
        keys = self.kv[layer, 0, :, :end].unsqueeze(0)
        values = self.kv[layer, 1, :, :end].unsqueeze(0)
        if start == 0 and (self.window is None or self.window >= self.num_tokens):
            out = _sdpa(qh, keys, values, None, causal=True)
        else:
            device = q.device
            mask = visible_mask(
                torch.arange(start, end, device=device)[:, None],
                torch.arange(end, device=device)[None, :],
                self.window,
            )
            out = _sdpa(qh, keys, values, mask)
        return out.squeeze(0).transpose(0, 1).reshape(self.num_tokens, -1)
