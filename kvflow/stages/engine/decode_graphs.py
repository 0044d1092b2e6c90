"""Decode steps in fixed shapes, replayed as CUDA graphs.

On a GPU a decode step of a small model is bound by launching kernels, not by computing
them: eager batch-1 decode of the 156M demo model took about 4.6 ms a step on an H200,
nearly all of it the host issuing some 200 small kernels (BENCHMARKS.md, "The engine on a
GPU"). A CUDA graph records a step's kernels once and replays them with one launch.

A graph replays fixed shapes and fixed addresses, so a step is cut to a bucket: the batch
padded to a power of two (at most ``max_batch``) and every row's page list padded to a
power of two of pages (at most the pages of ``max_model_len``, and of `CAPTURE_TOKENS`:
longer rows decode eagerly). Each bucket owns static
device tensors: one int64 block of rows ``[token, position, page ids...]`` that each step
copies in with one host-to-device copy, the `PaddedDecode` backend that derives slots and
the mask from it on the device, and the logits the forward leaves. Padding rows decode
token 0 at position 0 on the pool's spare page (`PagePool.spare_page`), which no request
holds. A bucket's graph is captured at its first use (a warm-up forward on a side stream,
then the capture; tens of milliseconds), and all graphs share one memory pool.

Modes (`EngineConfig.decode_graphs`): "auto" captures on a CUDA device and runs eagerly
elsewhere; "off" never uses this module; "static" runs the same padded forward without
capturing it, on any device: it is what a graph replays, so the CPU tests check the
padding, the buckets and the spare page against the eager path. Steps that also prefill
(mixed steps) always run eagerly. A bucket that cannot be built (out of device memory, an op
the installed torch cannot capture) is logged once and its steps run eagerly: none fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvflow.stages.engine.attention import PaddedDecode
from kvflow.stages.engine.model import CausalLM
from kvflow.stages.engine.pages import PagePool
from kvflow.stages.engine.sequence import Sequence

logger = logging.getLogger(__name__)


def graphs_apply(mode: str, device: torch.device) -> bool:
    """Whether an engine of `mode` on `device` runs its decode steps through `DecodeGraphs`."""
    return mode == "static" or (mode == "auto" and device.type == "cuda")


CAPTURE_TOKENS = 8192
"""The longest context a decode graph is captured for (vLLM's `max_seq_len_to_capture` is
the same idea): a batch with a longer row decodes eagerly. Every row of a bucket reads all of
its pages, so a wider bucket costs a batch of short rows the gather of long ones, and its
capture holds that memory in the graphs' pool."""


def graph_pages(max_model_len: int, block_size: int) -> int:
    """The widest bucket, in pages: those of ``min(max_model_len, CAPTURE_TOKENS)`` tokens."""
    return -(-min(max_model_len, CAPTURE_TOKENS) // block_size)


def bucket(n: int, limit: int) -> int:
    """The smallest power of two >= n, at most `limit` (n <= limit)."""
    return min(1 << max(n - 1, 0).bit_length(), limit)


@dataclass
class _Bucket:
    """One (batch, pages) shape: its static inputs, backend, forward and (captured) graph."""

    inputs: torch.Tensor  # int64 [batch, 2 + pages]: token, position, page ids
    kv: PaddedDecode
    forward: Callable[[], torch.Tensor]
    logits: torch.Tensor | None = None  # the captured forward's output (graphs only)
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """The decode steps of one engine in fixed-shape buckets (module doc). Not thread-safe:
    the engine's thread runs it."""

    def __init__(
        self,
        model: CausalLM,
        pool: PagePool,
        max_batch: int,
        max_pages: int,
        capture: bool,
    ) -> None:
        self.model, self.pool = model, pool
        self.max_batch, self.max_pages = max_batch, max_pages
        self.capture = capture
        self.spare = pool.spare_page()
        self.device = pool.tensor.device
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._failed: set[tuple[int, int]] = set()  # buckets that could not be built
        self._mempool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """The (batch, pages) buckets built so far, in order of first use."""
        return list(self._buckets)

    @torch.inference_mode()
    def run(self, seqs: Seq[Sequence]) -> torch.Tensor | None:
        """Float32 logits [len(seqs), vocab] of one decode step of `seqs` (their K/V written),
        or None when the batch exceeds the buckets (the caller decodes eagerly)."""
        bs = self.pool.layout.block_size
        rows = len(seqs)
        width = max(s.num_computed // bs + 1 for s in seqs)
        if rows > self.max_batch or width > self.max_pages:
            return None
        key = bucket(rows, self.max_batch), bucket(width, self.max_pages)
        entry = self._buckets.get(key)
        if entry is None:
            if key in self._failed:
                return None
            try:
                entry = self._build(*key)
            except RuntimeError as exc:  # out of memory, an op torch cannot capture: eager
                logger.warning("decode graph of bucket %s not built, eager instead: %s", key, exc)
                self._failed.add(key)
                return None
        pad = [0, 0] + [self.spare] * key[1]
        host = [[s.token_ids[-1], s.num_computed, *self._pages(s, key[1])] for s in seqs]
        host += [pad] * (key[0] - rows)
        entry.inputs.copy_(torch.tensor(host, dtype=torch.int64))
        if entry.graph is not None:
            entry.graph.replay()
            assert entry.logits is not None
            return entry.logits[:rows].clone()  # the next replay overwrites the static output
        return entry.forward()[:rows]

    def _pages(self, seq: Sequence, width: int) -> list[int]:
        """The first `width` entries of the row's page list: the pages it has up to its
        position, then the spare page (masked)."""
        own = seq.pages[: seq.num_computed // self.pool.layout.block_size + 1]
        return own + [self.spare] * (width - len(own))

    def _build(self, batch: int, pages: int) -> _Bucket:
        """A bucket's static tensors and forward; captured as a graph where capture is on."""
        inputs = torch.zeros((batch, 2 + pages), dtype=torch.int64, device=self.device)
        inputs[:, 2:] = self.spare  # every row a padding row until a step fills it
        ids, positions, table = inputs[:, 0], inputs[:, 1], inputs[:, 2:]
        kv = PaddedDecode(self.pool, table, positions, self.model.spec.sliding_window)

        def forward() -> torch.Tensor:
            kv.prepare()
            return self.model.logits(self.model(ids, positions, kv))

        entry = _Bucket(inputs, kv, forward)
        if self.capture:
            started = time.perf_counter()
            entry.graph, entry.logits = self._capture(forward)
            elapsed_ms = (time.perf_counter() - started) * 1e3
            logger.info(
                "decode graph of bucket (%d, %d) captured in %.0f ms", batch, pages, elapsed_ms
            )
        self._buckets[(batch, pages)] = entry
        return entry

    def _capture(
        self, forward: Callable[[], torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm `forward` up on a side stream (first-use allocations and kernel choices stay
        out of the graph), then capture it. Both run on padding rows: only the spare page is
        written."""
        with torch.cuda.device(self.device):  # capture on the engine's device, not cuda:0
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                forward()
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self._mempool, stream=side, capture_error_mode="thread_local"
            ):
                logits = forward()
        return graph, logits
