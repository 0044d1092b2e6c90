"""The stage runtime: bounded queues, per-stage workers, submission and shutdown.

::

    submit ──► [queue 0] ──► stage 0 workers ──► [queue 1] ──► stage 1 workers ──► ... ──► end
               bounded       (concurrency N0)     bounded       (concurrency N1)

Each stage has a bounded queue in front of it and as many workers as its concurrency limit; a
worker takes a request, runs ``Stage.run`` in a task of its own (so it can be cancelled alone),
then puts the request into the next queue, waiting while that queue is full. Many requests are
in flight at once, each in a different stage. A ``background`` stage is started as a child
task of the request and the request moves on at once (see ``Stage``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence
from typing import Any

from kvflow.pipeline.config import PipelineConfig
from kvflow.pipeline.context import RequestContext
from kvflow.pipeline.errors import (
    DeadlineExceeded,
    Overloaded,
    PipelineClosed,
    RequestCancelled,
    StageError,
)
from kvflow.pipeline.metrics import Metrics, PipelineMetrics
from kvflow.pipeline.run import RequestHandle, RequestRun, classify
from kvflow.pipeline.spans import Tracer
from kvflow.pipeline.stage import Stage

logger = logging.getLogger(__name__)


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Pipeline:
    """Runs requests through ``stages`` in order.

    Args:
        stages: at least one ``Stage``; names non-empty and unique.
        config: scheduling parameters (``PipelineConfig()`` when None).
        tracer: where finished request traces go (a ``Tracer(config.trace_capacity)`` when
            None); read it as ``pipeline.tracer``.
        metrics: when given, the runtime records its series on it (see ``PipelineMetrics``).

    Use from one event loop: ``start``, ``submit``, ``try_submit`` and ``stop`` must be called
    on the loop that runs the pipeline. ``RequestContext.cancel`` may come from any thread.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        config: PipelineConfig | None = None,
        tracer: Tracer | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config if config is not None else PipelineConfig()
        self.stages: tuple[Stage, ...] = _validate_stages(stages)
        self.tracer = tracer if tracer is not None else Tracer(self.config.trace_capacity)
        self.metrics = metrics
        self._metrics = PipelineMetrics(metrics) if metrics is not None else None
        self.limits: tuple[int, ...] = tuple(
            self.config.concurrency_for(stage.name, stage.concurrency) for stage in self.stages
        )
        self._state = _State.NEW
        self._queues: list[asyncio.Queue[RequestRun]] = []
        self._slots: list[asyncio.Semaphore] = []
        self._workers: list[asyncio.Task[None]] = []
        self._runs: set[RequestRun] = set()
        self._idle: asyncio.Event | None = None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the queues and start the workers. Raises PipelineClosed once stopped."""
        if self._state is _State.RUNNING:
            return
        if self._state is not _State.NEW:
            raise PipelineClosed("a stopped pipeline cannot be restarted")
        self._idle = asyncio.Event()
        self._idle.set()
        for index, stage in enumerate(self.stages):
            queue: asyncio.Queue[RequestRun] = asyncio.Queue(maxsize=self.config.queue_size)
            self._queues.append(queue)
            self._slots.append(asyncio.Semaphore(self.limits[index]))
            if self._metrics is not None:
                self._metrics.track_queue(stage.name, queue.qsize)
            workers = 1 if stage.background else self.limits[index]
            for number in range(workers):
                self._workers.append(
                    asyncio.create_task(self._worker(index), name=f"{stage.name}-worker-{number}")
                )
        self._state = _State.RUNNING
        logger.info(
            "pipeline started: stages=%s limits=%s queue_size=%d",
            [s.name for s in self.stages],
            list(self.limits),
            self.config.queue_size,
        )

    async def stop(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop accepting requests and shut down; idempotent.

        With ``drain`` every accepted request runs to its end first (for at most ``timeout_s``
        seconds, when given, after which the rest are failed as without drain). Without it,
        every unfinished request fails with ``PipelineClosed`` (running stages are cancelled,
        cleanups run). Returns when every request has ended and every worker has exited.
        """
        if self._state is _State.NEW:
            self._state = _State.STOPPED
            return
        if self._state is _State.STOPPED:
            return
        self._state = _State.STOPPING
        if drain:
            try:
                await asyncio.wait_for(self._wait_idle(), timeout_s)
            except TimeoutError:
                logger.warning("pipeline drain timed out after %ss; failing the rest", timeout_s)
        for run in list(self._runs):
            run.fail(
                PipelineClosed(
                    "pipeline stopped", stage=run.position, request_id=run.ctx.request_id
                )
            )
        await self._wait_idle()
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers.clear()
        self._state = _State.STOPPED
        logger.info("pipeline stopped")

    async def __aenter__(self) -> Pipeline:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop(drain=exc_info[0] is None)

    @property
    def running(self) -> bool:
        return self._state is _State.RUNNING

    def in_flight(self) -> int:
        """Requests accepted and not yet ended."""
        return len(self._runs)

    def queue_depths(self) -> dict[str, int]:
        """Stage name -> requests waiting in the queue in front of it."""
        return {stage.name: q.qsize() for stage, q in zip(self.stages, self._queues, strict=False)}

    # -- submission -------------------------------------------------------------------------

    async def submit(self, ctx: RequestContext[Any]) -> RequestHandle:
        """Accept ``ctx``, waiting while the first queue is full (backpressure).

        Raises PipelineClosed when not running, ValueError when ``ctx`` was submitted before.
        A request cancelled or timed out while waiting here is returned with that error.
        """
        run = self._accept(ctx)
        try:
            await self._put(self._queues[0], run)
        except asyncio.CancelledError:
            run.fail(
                RequestCancelled("submit cancelled", stage=run.position, request_id=ctx.request_id)
            )
            raise
        return RequestHandle(run)

    def try_submit(self, ctx: RequestContext[Any]) -> RequestHandle:
        """Accept ``ctx`` only if the first queue has room; else raise ``Overloaded``.

        Call on the pipeline's loop. Raises PipelineClosed when not running, ValueError when
        ``ctx`` was submitted before. ``ctx`` is untouched when it is refused.
        """
        self._check_running()
        queue = self._queues[0]
        if queue.full():
            if self._metrics is not None:
                self._metrics.overloaded.inc()
            raise Overloaded(queue.maxsize)
        run = self._accept(ctx)
        if not run.ending:
            queue.put_nowait(run)
        return RequestHandle(run)

    def _check_running(self) -> None:
        if self._state is not _State.RUNNING:
            raise PipelineClosed(f"pipeline is {self._state.value}, not running")

    def _accept(self, ctx: RequestContext[Any]) -> RequestRun:
        self._check_running()
        if not isinstance(ctx, RequestContext):
            raise TypeError(f"submit expects a RequestContext, got {type(ctx).__name__}")
        if ctx._owner is not None:
            raise ValueError(f"req={ctx.request_id}: context was already submitted")
        ctx._owner = self
        if ctx.deadline is None and self.config.default_deadline_s is not None:
            ctx.deadline = ctx.clock() + self.config.default_deadline_s
        run = RequestRun(
            ctx,
            self.stages[0].name,
            tracer=self.tracer,
            metrics=self._metrics,
            cleanup_timeout_s=self.config.cleanup_timeout_s,
            on_finished=self._finished,
        )
        self._runs.add(run)
        assert self._idle is not None
        self._idle.clear()
        run.arm()
        return run

    def _finished(self, run: RequestRun) -> None:
        self._runs.discard(run)
        if not self._runs and self._idle is not None:
            self._idle.set()

    async def _wait_idle(self) -> None:
        assert self._idle is not None
        while self._runs:
            await self._idle.wait()

    async def _put(self, queue: asyncio.Queue[RequestRun], run: RequestRun) -> None:
        """Put ``run`` into ``queue``, waiting for room unless the request ends meanwhile."""
        if run.ending:
            return
        if not queue.full():
            queue.put_nowait(run)
            return
        put = asyncio.ensure_future(queue.put(run))
        try:
            await asyncio.wait({put, run.done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not put.done():
                put.cancel()

    # -- workers ----------------------------------------------------------------------------

    async def _worker(self, index: int) -> None:
        stage = self.stages[index]
        queue = self._queues[index]
        while True:
            run = await queue.get()
            try:
                await self._step(run, index)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a runtime bug; never leave the request hanging
                logger.exception("req=%s runtime error at stage=%s", run.ctx.request_id, stage.name)
                run.fail(StageError(stage.name, run.ctx.request_id, exc))
            finally:
                queue.task_done()

    async def _step(self, run: RequestRun, index: int) -> None:
        stage = self.stages[index]
        ctx = run.ctx
        if run.ending:
            return
        if ctx.cancelled:
            reason = ctx.cancel_reason or "cancelled"
            run.fail(RequestCancelled(reason, stage=stage.name, request_id=ctx.request_id))
            return
        if ctx.expired:
            run.fail(DeadlineExceeded(stage.name, ctx.request_id, queued=True))
            return
        if stage.background:
            await self._start_background(run, index)
        else:
            await self._run_foreground(run, index)
        if run.ending:
            return
        if index + 1 == len(self.stages):
            run.last_stage_done()
        else:
            run.wait_next(self.stages[index + 1].name)
            await self._put(self._queues[index + 1], run)

    async def _run_foreground(self, run: RequestRun, index: int) -> None:
        stage = self.stages[index]
        queued_s = run.ctx.clock() - run.queued_at
        run.enter(stage)
        task = asyncio.create_task(
            self._invoke(run, stage, queued_s), name=f"{run.ctx.request_id}:{stage.name}"
        )
        run.fg_task = task
        started = asyncio.get_running_loop().time()
        if self._metrics is not None:
            self._metrics.inflight.labels(stage.name).inc()
        try:
            await asyncio.wait({task})
        finally:
            run.fg_task = None if task.done() else task
            if self._metrics is not None:
                self._metrics.inflight.labels(stage.name).dec()
                elapsed = asyncio.get_running_loop().time() - started
                self._metrics.stage_seconds.labels(stage.name).observe(elapsed)
        run.in_stage = False
        if task.cancelled():
            if not run.ending:
                run.fail(
                    RequestCancelled(
                        "stage task cancelled", stage=stage.name, request_id=run.ctx.request_id
                    )
                )
            return
        exc = task.exception()
        if exc is not None:
            run.fail(classify(exc, stage.name, run.ctx.request_id))

    async def _start_background(self, run: RequestRun, index: int) -> None:
        stage = self.stages[index]
        slots = self._slots[index]
        await slots.acquire()
        if run.ending:
            slots.release()
            return
        queued_s = run.ctx.clock() - run.queued_at
        if self._metrics is not None:
            self._metrics.inflight.labels(stage.name).inc()
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def body() -> None:
            run.began(stage)
            run.ctx.set_attr("queued_ms", queued_s * 1000.0)
            run.ctx.set_attr("background", True)
            await stage.run(run.ctx)

        def done(_: asyncio.Task[Any]) -> None:
            # On the task, not in body: a request failed or cancelled between the spawn and
            # the task's first step never runs body, and its slot must come back all the same.
            slots.release()
            if self._metrics is not None:
                self._metrics.inflight.labels(stage.name).dec()
                self._metrics.stage_seconds.labels(stage.name).observe(loop.time() - started)

        run.ctx.spawn(stage.name, body()).add_done_callback(done)

    @staticmethod
    async def _invoke(run: RequestRun, stage: Stage, queued_s: float) -> None:
        # Cleanup is owed only once run() begins: a task cancelled before its first step
        # never ran, so it took nothing.
        run.began(stage)
        with run.ctx.stage_span(stage.name, queued_ms=queued_s * 1000.0):
            await stage.run(run.ctx)


def _validate_stages(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    stages = tuple(stages)
    if not stages:
        raise ValueError("stages must hold at least one Stage")
    seen: set[str] = set()
    for position, stage in enumerate(stages):
        if not isinstance(stage, Stage):
            raise TypeError(f"stages[{position}] is {type(stage).__name__}, not a Stage")
        if not isinstance(stage.name, str) or not stage.name:
            raise ValueError(f"stages[{position}] ({stage!r}) has no name")
        if stage.name in seen:
            raise ValueError(f"stages[{position}]: duplicate stage name {stage.name!r}")
        if stage.concurrency is not None and (
            isinstance(stage.concurrency, bool)
            or not isinstance(stage.concurrency, int)
            or stage.concurrency < 1
        ):
            raise ValueError(
                f"stage {stage.name!r}: concurrency must be an int >= 1 or None, "
                f"got {stage.concurrency!r}"
            )
        seen.add(stage.name)
    return stages
