"""JobRunner: computes a job's pending items through the frontend's pipeline, at background
priority, within its budget.

Each item: tokens (materialize) → block keys → ``cached_blocks`` (match_prefix over the
prefill instances: what is cached is skipped) → the budget's grant → the missing blocks,
computed in segments of ``segment_blocks`` blocks. A segment is an ordinary prefill request
(``max_tokens=1``) of the item's first ``k`` full blocks: the route stage's conductor picks
the prefill instance (cached prefix, queue), reuse-load loads what earlier segments stored,
prefill stores the new blocks. Before every segment the runner waits until no online request
is running or queued (``WarmTarget.online_busy``), and at most ``prefill_slots()`` segments
run at once. **Preemption:** while segments run, a watcher cancels them as soon as an online
request enters the pipeline (the engine aborts them at its next step; blocks of the chunks
they finished stay stored), and they are retried, from what is cached, once the pipeline is
quiet again — a preempted try does not count against ``max_attempts``. So an online request
waits at most for the engine step already running.

**Verify:** when every item is finished, the items counted as cached are checked again
(``cached_blocks``); an item whose blocks were lost meanwhile (a node died) is computed again,
up to ``VERIFY_PASSES`` times.

Cancel: ``cancel()`` cancels the in-flight segments (their pages and bookings are released by
the stages' cleanup) and stops within a second; blocks stored so far stay cached.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kvflow.kvdb import block_keys
from kvflow.pipeline import RequestContext
from kvflow.stages.engine import SamplingParams
from kvflow.stages.state import GenerateState
from kvflow.stages.warmup.corpus import CorpusItem
from kvflow.stages.warmup.job import ItemResult, ItemState
from kvflow.stages.warmup.materialize import ItemError
from kvflow.stages.warmup.metrics import WarmupMetrics
from kvflow.stages.warmup.store import StoredJob
from kvflow.stages.warmup.target import WarmTarget

logger = logging.getLogger(__name__)

GATE_POLL_S = 0.005
SETTLE_S = 3.0  # how long to wait for the metadata to show blocks a segment stored
VERIFY_PASSES = 2
COVERED = (ItemState.WARMED, ItemState.CACHED, ItemState.TRUNCATED)


class BudgetReached(Exception):
    """The budget is spent and ``on_limit`` is ``stop``."""


class Preempted(Exception):
    """A segment was cancelled to let an online request run; it is tried again."""


class JobRunner:
    """Runs one job once (``await run()``); ``record(event)`` persists each item result."""

    def __init__(
        self,
        job: StoredJob,
        target: WarmTarget,
        record: Callable[[dict[str, Any]], None],
        metrics: WarmupMetrics | None = None,
        on_pins: Callable[[Any], None] | None = None,
    ) -> None:
        self.job = job
        self._target = target
        self._record = record
        self._metrics = metrics
        self._on_pins = on_pins
        self._opts = job.options
        self._ns = target.namespace(job.options.tenant)
        self._mat = target.materializer()
        self._limit = job.options.budget.limit_blocks(target.block_nbytes)
        self._used = sum(r.blocks_warmed for r in job.results.values())
        self._handles: set[Any] = set()
        self._preempted: set[Any] = set()
        self._cancelled = asyncio.Event()
        self.stop_reason = ""
        self.tokens_prefilled = 0
        self.preemptions = 0
        self.redone = 0

    # -- control ---------------------------------------------------------------------------
    def cancel(self) -> None:
        self._cancelled.set()
        for handle in list(self._handles):
            handle.cancel("warm-up job cancelled")

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def run(self) -> None:
        pending = [
            item
            for item in self.job.items
            if (r := self.job.results.get(item.index)) is None or not r.state.finished
        ]
        watcher = asyncio.create_task(self._watch())
        try:
            await self._pass(pending)
            for _ in range(VERIFY_PASSES):
                if self.cancelled or self.stop_reason:
                    break
                lost = await self._lost()
                if not lost:
                    break
                self.redone += len(lost)
                logger.warning(
                    "job=%s: %d finished items lost blocks; computing them again",
                    self.job.job_id,
                    len(lost),
                )
                await self._pass(lost)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _pass(self, items: list[CorpusItem]) -> None:
        queue: asyncio.Queue[CorpusItem] = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        workers = [
            asyncio.create_task(self._worker(queue)) for _ in range(self._target.prefill_slots())
        ]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _lost(self) -> list[CorpusItem]:
        """Finished items counted as cached whose leading blocks are no longer all cached;
        their budget is given back (the new result replaces the old)."""
        lost = []
        for item in self.job.items:
            r = self.job.results.get(item.index)
            if r is None or r.state not in COVERED:
                continue
            try:
                keys = block_keys(self._ns, self._mat.tokens(item))
            except ItemError:
                continue
            goal = r.blocks_cached_before + r.blocks_warmed
            if r.state is not ItemState.TRUNCATED:
                goal = len(keys)
            if await asyncio.to_thread(self._target.cached_blocks, keys[:goal]) < goal:
                self._used -= r.blocks_warmed
                lost.append(item)
        return lost

    async def _watch(self) -> None:
        """Preempt running segments while an online request is in the pipeline."""
        while True:
            await asyncio.sleep(GATE_POLL_S)
            if self._handles and self._target.online_busy(len(self._handles)):
                for handle in list(self._handles):
                    if handle not in self._preempted:
                        self._preempted.add(handle)
                        handle.cancel("warm-up segment preempted by an online request")

    async def _worker(self, queue: asyncio.Queue[CorpusItem]) -> None:
        while not self.cancelled and not self.stop_reason:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                result = await self._item(item)
            except BudgetReached:
                self.stop_reason = "budget limit reached"
                return
            if result is not None:
                self._finish(result)

    def _finish(self, result: ItemResult) -> None:
        self.job.results[result.index] = result
        self._record({"kind": "item", "result": result.to_dict()})
        if self._metrics is not None:
            self._metrics.item(result, self._target.block_nbytes)
        logger.info(
            "job=%s item=%d %s blocks=%d cached_before=%d warmed=%d %s",
            self.job.job_id,
            result.index,
            result.state.value,
            result.blocks_total,
            result.blocks_cached_before,
            result.blocks_warmed,
            result.error,
        )

    # -- one item --------------------------------------------------------------------------
    async def _item(self, item: CorpusItem) -> ItemResult | None:
        """The item's result; None when the job was cancelled mid-item (it stays pending)."""
        r = ItemResult(item.index)
        try:
            tokens = self._mat.tokens(item)
        except ItemError as exc:
            return _error(r, str(exc))
        r.tokens = len(tokens)
        if len(tokens) + 1 > self._target.max_model_len:
            return _error(
                r, f"{len(tokens)} tokens: over the model's maximum {self._target.max_model_len}"
            )
        keys = block_keys(self._ns, tokens)
        r.blocks_total = len(keys)
        if not keys:
            return _error(r, f"{len(tokens)} tokens: shorter than one block")
        r.blocks_cached_before = await asyncio.to_thread(self._target.cached_blocks, keys)
        goal = self._grant(r.blocks_total, r.blocks_cached_before)
        if goal is None:
            r.state = ItemState.OVER_BUDGET
            return r
        if goal > r.blocks_cached_before:
            done = await self._compute(item, r, tokens, goal)
            if done is None:
                return None
            after = await self._settle(keys[:goal], goal)
            r.blocks_warmed = max(0, min(after, goal) - r.blocks_cached_before)
            self._used -= (goal - r.blocks_cached_before) - r.blocks_warmed  # unused grant
            if not done:
                return r
            r.state = ItemState.WARMED if goal == r.blocks_total else ItemState.TRUNCATED
        else:
            r.state = ItemState.CACHED
        await self._place(keys[:goal])
        return r

    def _grant(self, total: int, cached: int) -> int | None:
        """How many leading blocks to have cached (reserving the new ones in the budget);
        None: skip the item; BudgetReached: stop the job."""
        need = total - cached
        if self._limit is None or need == 0:
            self._used += need
            return total
        left = self._limit - self._used
        if need <= left:
            self._used += need
            return total
        on_limit = self._opts.budget.on_limit
        if on_limit == "skip":
            return None
        if on_limit == "truncate" and left > 0:
            self._used += left
            return cached + left
        raise BudgetReached

    async def _compute(
        self, item: CorpusItem, r: ItemResult, tokens: list[int], goal: int
    ) -> bool | None:
        """Compute blocks ``[cached, goal)`` segment by segment. True when all ran, False when
        a segment failed every attempt (``r`` says why), None when cancelled."""
        bs, seg = self._target.block_size, self._opts.segment_blocks
        ends = [*range(r.blocks_cached_before + seg, goal, seg), goal]
        for n, end in enumerate(ends):
            attempt = tries = 0
            while True:
                if not await self._gate():
                    return None
                tries += 1
                rid = f"warmup-{self.job.job_id}-{item.index}-{n}-{tries}"
                try:
                    r.instance = await self._segment(rid, tokens[: end * bs])
                    start = ends[n - 1] if n else r.blocks_cached_before
                    self.tokens_prefilled += (end - start) * bs
                    break
                except Preempted:
                    self.preemptions += 1
                    logger.debug("job=%s %s preempted", self.job.job_id, rid)
                except Exception as exc:
                    if self.cancelled:
                        return None
                    attempt += 1
                    logger.warning("job=%s %s failed: %s", self.job.job_id, rid, exc)
                    if attempt == self._opts.max_attempts:
                        _error(r, f"segment {n} failed {attempt} times: {exc}")
                        return False
        return True

    async def _gate(self) -> bool:
        """Wait until no online request runs; False when the job is cancelled meanwhile."""
        while self._target.online_busy(len(self._handles)):
            if self.cancelled:
                return False
            await asyncio.sleep(GATE_POLL_S)
        return not self.cancelled

    async def _segment(self, request_id: str, prompt: list[int]) -> str:
        state = GenerateState(
            tenant=self._opts.tenant,
            max_tokens=1,
            sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
            prompt_ids=prompt,
            submitted_at=time.monotonic(),
        )
        handle = self._target.submit(request_id, state)
        self._handles.add(handle)
        try:
            ctx: RequestContext[Any] = await handle.result()
        except Exception as exc:
            if handle in self._preempted and not self.cancelled:
                raise Preempted(request_id) from exc
            raise
        finally:
            self._handles.discard(handle)
            self._preempted.discard(handle)
        decision = ctx.state.decision
        return "" if decision is None else str(decision.prefill_id)

    async def _settle(self, keys: list[bytes], goal: int) -> int:
        """Cached leading blocks, waiting up to SETTLE_S for the metadata to catch up."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            n = await asyncio.to_thread(self._target.cached_blocks, keys)
            if n >= goal or time.monotonic() > deadline:
                return n
            await asyncio.sleep(0.05)

    async def _place(self, keys: list[bytes]) -> None:
        """Replica target and pins for an item's blocks."""
        if self._opts.replicas > 0:
            await asyncio.to_thread(self._target.set_replica_target, keys, self._opts.replicas)
        if self._opts.pin_ttl_s > 0 and self._on_pins is not None:
            try:
                token = await asyncio.to_thread(
                    self._target.pin, self._ns, keys, self._opts.pin_ttl_s
                )
                self._on_pins(token)
            except Exception:
                logger.warning(
                    "job=%s: pinning %d blocks failed", self.job.job_id, len(keys), exc_info=True
                )


def _error(r: ItemResult, message: str) -> ItemResult:
    r.state, r.error = ItemState.ERROR, message
    return r
