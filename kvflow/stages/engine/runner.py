"""The model runner: turns planned work into forward passes over the paged KV pool.

Each prefill chunk is one forward over that request's tokens; the decode batch is one
forward over one token per request; `mixed` runs several of those as one forward.
Logits are computed only for rows that sample. Not thread-safe; runs under torch.inference_mode.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from kvflow.stages.engine.attention import PagedDecode, PagedPrefill
from kvflow.stages.engine.decode_graphs import DecodeGraphs
from kvflow.stages.engine.model import CausalLM, KVAttention
from kvflow.stages.engine.pages import PagePool
from kvflow.stages.engine.segments import Segments
from kvflow.stages.engine.sequence import Sequence


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: PagePool,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        """``graphs``: decode-only steps in fixed shapes (decode_graphs.py), if set."""
        self.model = model
        self.pool = pool
        self.device = device
        self.window = model.spec.sliding_window
        self.graphs = graphs

    def _page_ids(self, seq: Sequence) -> torch.Tensor:
        if seq.page_table is None:
            seq.page_table = torch.tensor(seq.pages, dtype=torch.int64, device=self.device)
        return seq.page_table

    @torch.inference_mode()
    def prefill(
        self, seq: Sequence, num_tokens: int, all_logits: bool = False
    ) -> torch.Tensor | None:
        """Compute KV for tokens [num_computed, num_computed + num_tokens) of `seq` (does not
        advance the counter). Returns float32 logits [vocab] of the last token if the chunk
        reaches the end of the sequence, else None; with `all_logits`, float32 logits
        [num_tokens, vocab] of every position of the chunk."""
        start = seq.num_computed
        end = start + num_tokens
        ids = torch.tensor(seq.token_ids[start:end], dtype=torch.int64, device=self.device)
        positions = torch.arange(start, end, dtype=torch.int64, device=self.device)
        kv = PagedPrefill(self.pool, self._page_ids(seq), start, num_tokens, self.window)
        hidden = self.model(ids, positions, kv)
        if all_logits:
            return self.model.logits(hidden)
        if end < len(seq.token_ids):
            return None
        return self.model.logits(hidden[-1:])[0]

    @torch.inference_mode()
    def decode(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Compute KV for the last token of each sequence; float32 logits [len(seqs), vocab].
        Through the decode graphs where the engine has them and the batch fits a bucket."""
        if self.graphs is not None:
            logits = self.graphs.run(seqs)
            if logits is not None:
                return logits
        ids, positions, kv = self._decode_inputs(seqs)
        return self.model.logits(self.model(ids, positions, kv))

    @torch.inference_mode()
    def mixed(
        self, chunks: Seq[tuple[Sequence, int]], decode: Seq[Sequence]
    ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """Prefill chunks and a decode batch in ONE forward pass (segments.py): the weights
        are read once for all rows. Returns, per chunk, float32 logits [vocab] of its last
        token if the chunk reaches the end of its sequence (else None), and the decode
        batch's float32 logits [len(decode), vocab] (None without decode). Does not advance
        the counters."""
        dev = self.device
        ids_parts: list[torch.Tensor] = []
        pos_parts: list[torch.Tensor] = []
        parts: list[tuple[int, KVAttention]] = []
        last_rows: list[int | None] = []  # per chunk: the row to sample, if it ends its prompt
        row = 0
        for seq, n in chunks:
            start, end = seq.num_computed, seq.num_computed + n
            ids_parts.append(torch.tensor(seq.token_ids[start:end], dtype=torch.int64, device=dev))
            pos_parts.append(torch.arange(start, end, dtype=torch.int64, device=dev))
            parts.append((n, PagedPrefill(self.pool, self._page_ids(seq), start, n, self.window)))
            row += n
            last_rows.append(row - 1 if end == len(seq.token_ids) else None)
        if decode:
            ids, positions, kv = self._decode_inputs(decode)
            ids_parts.append(ids)
            pos_parts.append(positions)
            parts.append((len(decode), kv))
        hidden = self.model(torch.cat(ids_parts), torch.cat(pos_parts), Segments(parts))
        sampled = [r for r in last_rows if r is not None]
        rows = sampled + list(range(row, row + len(decode)))
        if not rows:
            return [None] * len(last_rows), None
        logits = self.model.logits(hidden[rows])
        index = iter(range(len(sampled)))
        chunk_logits = [None if r is None else logits[next(index)] for r in last_rows]
        return chunk_logits, (logits[len(sampled) :] if decode else None)

    def _decode_inputs(self, seqs: Seq[Sequence]) -> tuple[torch.Tensor, torch.Tensor, PagedDecode]:
        """Token ids [B], positions [B] and the paged backend of a decode batch."""
        bs = self.pool.layout.block_size
        positions_list = [s.num_computed for s in seqs]
        width = max(p // bs + 1 for p in positions_list)
        rows = []
        for s in seqs:
            table = s.pages[:width]
            rows.append(table + [table[0]] * (width - len(table)))  # pad: masked out
        page_table = torch.tensor(rows, dtype=torch.int64, device=self.device)
        positions = torch.tensor(positions_list, dtype=torch.int64, device=self.device)
        ids = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.int64, device=self.device)
        return ids, positions, PagedDecode(self.pool, page_table, positions, self.window)
