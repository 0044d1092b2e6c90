"""WarmupManager: the jobs of one process. Submit parses and persists a job; one job runs at a
time (FIFO) through a JobRunner; status, list, cancel and report read and steer them. At start
it resumes every job its store holds unfinished; at stop it interrupts the running job without
cancelling it (the next start resumes it). Pins taken for ``pin_ttl_s`` are released when the
TTL lapses or at stop. Every method runs on the event loop.

With a shared store (``JobStore.shared``: the metadata group, every router), the manager runs
only the jobs it claimed, shows every router's jobs (re-read each ``ADOPT_S``), adopts a job
whose owner's claim lapsed (a router that died), and stops a job another router took over."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvflow.stages.warmup.corpus import CorpusError, CorpusFile, parse_corpus
from kvflow.stages.warmup.coverage import Estimate, ItemCoverage, Totals, coverage, estimate
from kvflow.stages.warmup.job import ItemState, JobOptions, JobState
from kvflow.stages.warmup.metrics import WarmupMetrics
from kvflow.stages.warmup.runner import JobRunner
from kvflow.stages.warmup.store import JobStore, StoredJob, apply_event
from kvflow.stages.warmup.target import WarmTarget

logger = logging.getLogger(__name__)

PIN_POLL_S = 0.2
ADOPT_S = 1.0


class JobError(ValueError):
    """Bad job input (empty corpus, budget under one block, unknown job): INVALID_ARGUMENT
    or NOT_FOUND at the API."""


class UnknownJob(JobError):
    pass


@dataclass
class JobView:
    """A job's progress, derived from its results."""

    job_id: str
    state: str
    tenant: str
    items_total: int
    items_finished: int
    by_state: dict[str, int]
    blocks_warmed: int
    bytes_warmed: int
    tokens_prefilled: int
    elapsed_s: float
    eta_s: float
    stopped_reason: str
    runs: int
    errors: list[str] = field(default_factory=list)


class WarmupManager:
    def __init__(self, target: WarmTarget, store: JobStore, metrics: Any | None = None) -> None:
        self._target = target
        self._store = store
        self._metrics = WarmupMetrics(metrics) if metrics is not None else None
        self._jobs: dict[str, StoredJob] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._runner: JobRunner | None = None
        self._started: dict[str, float] = {}  # job id -> monotonic start of this run
        self._finished_at_start: dict[str, int] = {}  # job id -> items finished before it
        self._pins: list[tuple[float, Any]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._mine: set[str] = set()  # claimed by this process: queued or running
        self._adopting = asyncio.Lock()  # one read-and-claim pass at a time

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self._adopt()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._loop()), loop.create_task(self._expire_pins())]
        if self._store.shared:
            self._tasks.append(loop.create_task(self._adopt_loop()))

    async def _adopt(self) -> None:
        """Read the store: show every job; queue the unfinished ones nobody else runs."""
        async with self._adopting:
            await self._adopt_once()

    async def _adopt_once(self) -> None:
        running = self._runner.job.job_id if self._runner is not None else None
        for job in await asyncio.to_thread(self._store.load_all):
            if job.job_id == running:
                continue  # this process's copy is the newest
            if job.job_id not in self._mine:
                self._jobs[job.job_id] = job
            if job.state.final or job.job_id in self._mine:
                continue
            if not self._store.claimable(job.job_id):
                continue
            if await asyncio.to_thread(self._store.claim, job.job_id):
                logger.info("warm-up job=%s resumes (%d items finished)", job.job_id, _done(job))
                self._jobs[job.job_id] = job
                self._mine.add(job.job_id)
                self._queue.put_nowait(job.job_id)
        self._update_gauge()

    async def _adopt_loop(self) -> None:
        while True:
            await asyncio.sleep(ADOPT_S)
            runner = self._runner
            if runner is not None and self._store.lost(runner.job.job_id):
                logger.warning(
                    "warm-up job=%s: taken over elsewhere; stopping here", runner.job.job_id
                )
                runner.cancel()
            try:
                await self._adopt()
            except Exception:
                logger.warning("warm-up: reading the job store failed", exc_info=True)

    async def stop(self) -> None:
        """Interrupt the running job (it resumes at the next start) and release every pin."""
        self._stopping = True
        if self._runner is not None:
            self._runner.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for _, token in self._pins:
            self._target.unpin(token)
        self._pins.clear()
        await asyncio.to_thread(self._store.close)

    # -- API ---------------------------------------------------------------------------------
    async def submit(
        self, files: list[CorpusFile], options: JobOptions, dry_run: bool = False
    ) -> tuple[JobView | None, Estimate | None, list[CorpusError]]:
        """Parse the corpus; a dry run returns its estimate, else the new job's view."""
        try:
            options.budget.limit_blocks(self._target.block_nbytes)
            items, errors = parse_corpus(files, options.format)
        except ValueError as exc:
            raise JobError(str(exc)) from exc
        if options.pin_ttl_s > 0 and not self._target.supports_pins:
            raise JobError("pin_ttl_s: pins are not supported here (a cluster router)")
        if not items:
            detail = f" ({len(errors)} malformed lines)" if errors else ""
            raise JobError(f"the corpus has no items{detail}")
        if dry_run:
            est = await asyncio.to_thread(estimate, items, options, self._target)
            return None, est, errors
        job = StoredJob(uuid.uuid4().hex[:12], options, items, errors, time.time())
        await asyncio.to_thread(self._store.create, job)
        self._jobs[job.job_id] = job
        self._mine.add(job.job_id)
        if self._metrics is not None:
            self._metrics.corpus_errors(len(errors))
        self._queue.put_nowait(job.job_id)
        self._update_gauge()
        logger.info(
            "warm-up job=%s submitted: %d items, %d bad lines", job.job_id, len(items), len(errors)
        )
        return self.view(job.job_id), None, errors

    async def status(self, job_id: str) -> JobView:
        """The job's view; a job this process has not seen yet is looked up in the store."""
        await self._find(job_id)
        return self.view(job_id)

    def view(self, job_id: str) -> JobView:
        job = self._get(job_id)
        results = job.results.values()
        by_state: dict[str, int] = {}
        for r in results:
            by_state[r.state.value] = by_state.get(r.state.value, 0) + 1
        finished = sum(by_state.values())
        blocks = sum(r.blocks_warmed for r in results)
        started = self._started.get(job_id)
        elapsed = time.monotonic() - started if started is not None else 0.0
        runner = self._runner if self._runner and self._runner.job is job else None
        eta = 0.0
        if runner is not None and elapsed > 0:
            done_now = finished - self._finished_at_start.get(job_id, 0)
            rate = done_now / elapsed
            eta = (len(job.items) - finished) / rate if rate > 0 else -1.0
        errors = [str(e) for e in job.errors]
        errors += [
            f"item {r.index}: {r.error}" for r in sorted(results, key=lambda r: r.index) if r.error
        ]
        return JobView(
            job_id=job.job_id,
            state=job.state.value,
            tenant=job.options.tenant,
            items_total=len(job.items),
            items_finished=finished,
            by_state=by_state,
            blocks_warmed=blocks,
            bytes_warmed=blocks * self._target.block_nbytes,
            tokens_prefilled=sum(r.blocks_warmed * self._target.block_size for r in results),
            elapsed_s=elapsed,
            eta_s=eta,
            stopped_reason=job.stopped_reason,
            runs=job.runs,
            errors=errors,
        )

    def list(self) -> list[JobView]:
        return [self.view(j) for j in self._jobs]

    async def cancel(self, job_id: str) -> JobView:
        """Stop the job (within a second); what it cached stays. Cancelling a finished job
        changes nothing."""
        job = await self._find(job_id)
        if not job.state.final:
            if job_id not in self._mine:
                if not await asyncio.to_thread(self._store.claim, job_id):
                    raise JobError(f"job {job_id} runs on another router: cancel it there")
                self._mine.add(job_id)
            self._set_state(job, JobState.CANCELLED, "cancelled")
            if self._runner is not None and self._runner.job is job:
                self._runner.cancel()
        return self.view(job_id)

    async def report(self, job_id: str) -> tuple[list[ItemCoverage], Totals]:
        job = await self._find(job_id)
        return await asyncio.to_thread(coverage, job.items, job.options, self._target)

    # -- running -----------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            job = self._jobs[await self._queue.get()]
            if not job.state.final and not self._store.lost(job.job_id):
                try:
                    await self._run(job)
                except Exception as exc:
                    logger.exception("warm-up job=%s failed", job.job_id)
                    self._set_state(job, JobState.FAILED, f"failed: {exc}")
            if self._stopping:
                continue  # stop() gives every job up
            if job.state.final or self._store.lost(job.job_id):
                self._mine.discard(job.job_id)
                await asyncio.to_thread(self._store.release, job.job_id)

    async def _run(self, job: StoredJob) -> None:
        self._record(job, {"kind": "run"})
        self._set_state(job, JobState.RUNNING, "")
        self._started[job.job_id] = time.monotonic()
        self._finished_at_start[job.job_id] = _done(job)
        runner = JobRunner(
            job, self._target, lambda e: self._record(job, e), self._metrics, self._pin_taken
        )
        self._runner = runner
        try:
            await runner.run()
        finally:
            self._runner = None
        if self._stopping or job.state is JobState.CANCELLED or self._store.lost(job.job_id):
            return  # an interrupted job resumes at the next start; a cancelled one is final
        self._set_state(job, JobState.DONE, runner.stop_reason)
        logger.info("warm-up job=%s done: %s", job.job_id, self.view(job.job_id).by_state)

    def _record(self, job: StoredJob, event: dict[str, Any]) -> None:
        self._store.append(job.job_id, event)
        if event["kind"] == "run":
            apply_event(job, event)

    def _set_state(self, job: StoredJob, state: JobState, reason: str) -> None:
        event = {"kind": "state", "state": state.value, "reason": reason}
        self._store.append(job.job_id, event)
        apply_event(job, event)
        self._update_gauge()

    def _update_gauge(self) -> None:
        if self._metrics is None:
            return
        for s in JobState:
            self._metrics.jobs.labels(state=s.value).set(
                sum(1 for j in self._jobs.values() if j.state is s)
            )

    def _pin_taken(self, token: Any) -> None:
        job = self._runner.job if self._runner is not None else None
        ttl = job.options.pin_ttl_s if job is not None else 0.0
        self._pins.append((time.monotonic() + ttl, token))

    async def _expire_pins(self) -> None:
        while True:
            await asyncio.sleep(PIN_POLL_S)
            now = time.monotonic()
            keep = []
            for expiry, token in self._pins:
                if expiry <= now:
                    self._target.unpin(token)
                else:
                    keep.append((expiry, token))
            self._pins = keep

    async def _find(self, job_id: str) -> StoredJob:
        """The job, read from a shared store when this process has not seen it yet: a job
        another router accepted a moment ago (its record was committed before that router
        answered) is found at once, and adopted when its owner's lease lapsed."""
        if job_id not in self._jobs and self._store.shared and not self._stopping:
            await self._adopt()
        return self._get(job_id)

    def _get(self, job_id: str) -> StoredJob:
        job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJob(f"no warm-up job {job_id!r}")
        return job


def _done(job: StoredJob) -> int:
    return sum(1 for r in job.results.values() if r.state is not ItemState.PENDING)
