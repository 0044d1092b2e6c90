"""reuse-load: bring the matched prefix blocks into page buffers for the prefill engine.

1. The conductor's pull plan (``state.pull``: holder, blocks), exactly: the blocks are copied
   from the holder's shard into this instance's shard, which replicates hot blocks by itself
   (Algorithm 1). The same in the embedded server and on a prefill node, where the plan came
   in the Prefill call.
2. A continuation of the local prefix held elsewhere. When the conductor decides pulls
   (``state.pulls_decided``), only from shards it does not route to (a decode instance's
   generated blocks, which a follow-up turn starts with), plus, as the fallback, the planned
   blocks the holder failed to give. When the policy is cache-blind, from any shard.
3. The local prefix is pinned and read with one batch get_into into page-shaped tensors. A
   pinned block cannot be evicted, so a miss there is a block that failed its checksum (a
   corrupt record, or a valid one stored under another key): the shard drops it, the prefix
   ends before it (the rest is recomputed), every pin past it is released at once, and the
   event is counted (``corrupt_blocks``, the ``reuse_corrupt_blocks`` metric, the span).
   Requests of the same prefix at the same time share one read and its buffers
   (``runtime/shared_loads.py``; the ``reuse_shared_loads`` metric, ``shared`` on the span):
   the questions after one system prompt read it once, not once each.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from kvflow.kvdb import BlockKey, EmbeddedClient, Tier
from kvflow.pipeline import Metrics, RequestContext, Stage
from kvflow.stages.errors import NoCapacity
from kvflow.stages.runtime.instances import ShardOwner
from kvflow.stages.runtime.shared_loads import Read, SharedLoads
from kvflow.stages.runtime.staging import StagingArea
from kvflow.stages.state import GenerateState

logger = logging.getLogger(__name__)


class ReuseLoadStage(Stage):
    """Fills ``state.prefix_pages``, ``num_cached_tokens``, ``cached_by_tier``,
    ``pulled_tokens`` and ``pinned_keys``. Cleanup unpins whatever is still pinned.
    ``corrupt_blocks``: prefix blocks that failed their checksum here since start (read from
    any thread); with ``metrics``, also the ``reuse_corrupt_blocks`` counter."""

    name = "reuse-load"

    def __init__(
        self,
        holders: Mapping[str, ShardOwner],
        page_shape: tuple[int, ...],
        page_dtype: torch.dtype,
        block_size: int,
        peers: Mapping[str, ShardOwner] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._holders = holders  # where a planned pull reads from, by instance id
        # Not ``peers or {}``: a live mapping (RemotePeers) is empty while this node is the
        # first to register, and must still be the one read later.
        self._peers: Mapping[str, ShardOwner] = peers if peers is not None else {}
        self._page_shape = page_shape
        self._page_dtype = page_dtype
        self._block_size = block_size
        self._lock = threading.Lock()
        self.corrupt_blocks = 0
        self._corrupt_metric = (
            metrics.counter(
                "reuse_corrupt_blocks",
                "Prefix blocks that failed their checksum in reuse-load (recomputed)",
            )
            if metrics is not None
            else None
        )
        self._loads = SharedLoads()
        self._shared_metric = (
            metrics.counter(
                "reuse_shared_loads",
                "Prefix reads in reuse-load taken from a concurrent request of the same prefix",
            )
            if metrics is not None
            else None
        )

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        assert state.prefill is not None and state.namespace is not None
        # At least one prompt token is always computed: it yields the first token's logits.
        limit = state.prompt_len - 1
        if state.max_reuse_tokens is not None:
            limit = min(limit, state.max_reuse_tokens)
        usable = state.block_keys[: max(0, limit) // self._block_size]
        client = state.prefill.client(state.namespace)
        pull = state.pull
        pulled: set[int] = set()
        fallback = not state.pulls_decided  # cache-blind policy: any continuation
        if pull is not None and usable:
            start = min(pull.start_block, len(usable))
            stop = min(pull.start_block + pull.num_blocks, len(usable))
            with ctx.span("reuse-load.pull", source=pull.from_instance) as span:
                copied = await asyncio.to_thread(
                    self._planned_pull, pull.from_instance, state, client, usable, start, stop
                )
                span.set_attrs(blocks=copied, bytes=copied * self._page_nbytes())
            pulled.update(range(start, start + copied))
            fallback = fallback or copied < stop - start
        if usable and self._peers:
            # A shard elsewhere may hold how the local prefix goes on: e.g. a decode instance
            # holds the blocks of an answer it generated, which a follow-up turn starts with.
            with ctx.span("reuse-load.continue") as span:
                start, copied, source = await asyncio.to_thread(
                    self._continue_from_peers, state, client, usable, fallback
                )
                span.set_attrs(blocks=copied, source=source)
            pulled.update(range(start, start + copied))
        with ctx.span("reuse-load.local") as span:
            hits, tiers, corrupt, shared = await self._load_local(client, usable, state)
            span.set_attrs(blocks=hits, bytes=hits * self._page_nbytes())
            if corrupt:
                span.set_attrs(corrupt_blocks=corrupt)
            if shared:  # another request of this prefix read it: no bytes read here
                span.set_attrs(shared=True)
                if self._shared_metric is not None:
                    self._shared_metric.inc()
        by_tier: dict[str, int] = {}
        for i, tier in enumerate(tiers[:hits]):
            name = "remote" if i in pulled else tier.name.lower()
            by_tier[name] = by_tier.get(name, 0) + self._block_size
        state.cached_by_tier = by_tier
        state.num_cached_tokens = hits * self._block_size
        state.pulled_tokens = by_tier.get("remote", 0)
        ctx.set_attrs(cached_tokens=state.num_cached_tokens, blocks_hit=hits, **by_tier)

    def _page_nbytes(self) -> int:
        n = 1
        for d in self._page_shape:
            n *= d
        return n * torch.empty((), dtype=self._page_dtype).element_size()

    def _new_pages(self, n: int) -> list[torch.Tensor]:
        return [torch.empty(self._page_shape, dtype=self._page_dtype) for _ in range(n)]

    def _read_buffers(
        self, staging: StagingArea | None, client: EmbeddedClient, keys: list[BlockKey]
    ) -> Read:
        """Read ``keys``' blocks into page buffers leased from the instance's load staging
        (allocated once), or fresh ones when it is short of slots."""
        bufs, free = None, _nothing
        if staging is not None:
            try:
                lease = staging.lease(len(keys))
            except NoCapacity:
                pass
            else:
                bufs, free = staging.pages(lease, len(keys)), partial(staging.release, lease)
        if bufs is None:
            bufs = self._new_pages(len(keys))
        try:
            tiers = client.batch_get_into(keys, bufs)
        except BaseException:
            free()
            raise
        return bufs, tiers, free

    def _planned_pull(
        self,
        holder_id: str,
        state: GenerateState,
        client: EmbeddedClient,
        keys: list[BlockKey],
        start: int,
        stop: int,
    ) -> int:
        """The conductor's pull; 0 (logged) when the holder is unknown or its read fails."""
        holder = self._holders.get(holder_id)
        if holder is None:
            logger.warning("planned pull: holder %s is not known here", holder_id)
            return 0
        try:
            return self._pull(holder.client(state.namespace), client, keys, start, stop)
        except Exception as exc:  # a lost cache block must never fail the request
            logger.warning("planned pull: reading from %s failed: %r", holder_id, exc)
            return 0

    def _continue_from_peers(
        self,
        state: GenerateState,
        client: EmbeddedClient,
        keys: list[BlockKey],
        any_peer: bool = True,
    ) -> tuple[int, int, str]:
        """Copy the longest continuation of the local prefix found on other shards into the
        local one: from the holder of the longest run first; where a read fails (the holder
        died, a transfer timed out, a checksum is wrong), from the next holder of what is
        still missing; what no holder could give is recomputed. Returns (first block copied,
        blocks copied, the sources, comma-separated, or "")."""
        assert state.prefill is not None and state.namespace is not None
        local = client.match_prefix(keys)
        pos, sources, tried = local, [], {state.prefill.instance_id}
        while pos < len(keys):
            best, source = 0, None
            for pid, peer in self._peers.items():
                if pid in tried or not (any_peer or getattr(peer, "kind", "") != "prefill"):
                    continue
                n = peer.match_prefix(keys[pos:])
                if n > best:
                    best, source = n, pid
            if source is None:
                break
            tried.add(source)
            try:
                copied = self._pull(
                    self._peers[source].client(state.namespace), client, keys, pos, pos + best
                )
            except Exception as exc:  # a lost cache block must never fail the request
                logger.warning("continuation: reading from %s failed: %r", source, exc)
                copied = 0
            if copied < best:
                logger.warning(
                    "continuation: %s holds %d blocks past %d, only %d could be read; "
                    "trying another holder",
                    source,
                    best,
                    pos,
                    copied,
                )
            if copied:
                sources.append(source)
                pos += copied
        return local, pos - local, ",".join(sources)

    def _pull(
        self,
        holder: EmbeddedClient,
        local: EmbeddedClient,
        keys: list[BlockKey],
        start: int,
        stop: int,
    ) -> int:
        """Copy blocks [start, stop) from the holder's shard into ours; returns how many
        leading ones were copied (a block evicted at the holder meanwhile ends the run)."""
        if stop <= start:
            return 0
        want = keys[start:stop]
        bufs = self._new_pages(len(want))
        tiers = holder.batch_get_into(want, bufs)
        n = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        if n:
            parents: list[bytes | None] = [
                keys[i - 1] if i > 0 else None for i in range(start, start + n)
            ]
            local.batch_put(want[:n], bufs[:n], parents=parents)
        return n

    def _pin_local(self, client: EmbeddedClient, keys: list[BlockKey], state: GenerateState) -> int:
        """Pin the local prefix; the blocks pinned (``state.pinned_keys``)."""
        n = client.match_prefix(keys)
        if n == 0:
            return 0
        pinned = client.pin(keys[:n])
        # A block evicted between match and pin ends the usable run.
        n = next((i for i, ok in enumerate(pinned) if not ok), n)
        client.unpin([keys[i] for i in range(n, len(pinned)) if pinned[i]])
        state.pinned_keys = list(keys[:n])
        return n

    async def _load_local(
        self, client: EmbeddedClient, keys: list[BlockKey], state: GenerateState
    ) -> tuple[int, list[Tier], int, bool]:
        """Pin and read the local prefix: (blocks usable, their tiers, blocks found corrupt,
        whether the read was another request's). Requests of the same prefix at the same time
        share one read (SharedLoads)."""
        assert state.prefill is not None
        n = await asyncio.to_thread(self._pin_local, client, keys, state)
        if n == 0:
            return 0, [], 0, False
        read = partial(self._read_buffers, state.prefill.load_staging, client, keys[:n])
        key = (state.prefill.instance_id, state.namespace, n, keys[n - 1])
        (bufs, tiers, _), state.load_share, led = await self._loads.load(key, read)
        # Pinned blocks are never evicted: a miss failed its checksum (the shard dropped it,
        # its pin stays owed until unpinned). The run ends there; the rest is recomputed.
        hits = next((i for i, t in enumerate(tiers) if t is None), n)
        corrupt = sum(1 for t in tiers[hits:] if t is None) if led else 0
        if hits < n:
            state.pinned_keys = list(keys[:hits])
            client.unpin(keys[hits:n])
            if corrupt:
                self._count_corrupt(state, keys[hits], corrupt)
        state.prefix_pages = bufs[:hits]
        return hits, [t for t in tiers[:hits] if t is not None], corrupt, not led

    def _count_corrupt(self, state: GenerateState, first: BlockKey, n: int) -> None:
        with self._lock:
            self.corrupt_blocks += n
        if self._corrupt_metric is not None:
            self._corrupt_metric.inc(n)
        logger.warning(
            "reuse-load: tenant=%s %d prefix blocks failed their checksum, first key=%s; "
            "recomputing from there",
            state.tenant,
            n,
            first.hex(),
        )

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        unpin_prefix(ctx.state)
        release_load_buffers(ctx.state)


def release_load_buffers(state: GenerateState) -> None:
    """Let go of the prefix's page buffers (idempotent): the engine has copied them, or the
    request failed. The last request holding a shared read returns its staging slots."""
    state.prefix_pages = []
    if state.load_share is not None:
        share, state.load_share = state.load_share, None
        share.release()


def _nothing() -> None:
    """Freeing fresh page buffers: the garbage collector's."""


def unpin_prefix(state: GenerateState) -> None:
    """Unpin the prefix blocks this request pinned (idempotent)."""
    if state.pinned_keys and state.prefill is not None and state.namespace is not None:
        keys, state.pinned_keys = state.pinned_keys, []
        state.prefill.client(state.namespace).unpin(keys)
