"""One request's life inside a pipeline: failure, waiting for its tasks, cleanup, the end.

``RequestRun`` is the runtime's private record of a submitted request; ``RequestHandle`` is
what the caller holds. Everything here runs on the pipeline's event loop unless noted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvflow.pipeline.context import RequestContext
from kvflow.pipeline.errors import (
    DeadlineExceeded,
    FinalError,
    PipelineClosed,
    PipelineError,
    RequestCancelled,
    StageError,
)
from kvflow.pipeline.metrics import PipelineMetrics
from kvflow.pipeline.spans import RequestTrace, Tracer, TraceStatus
from kvflow.pipeline.stage import Stage

logger = logging.getLogger(__name__)


def classify(exc: BaseException, stage: str, request_id: str) -> PipelineError:
    """The error a request ends with when ``stage`` raised ``exc`` (see pipeline.errors)."""
    if isinstance(exc, FinalError | DeadlineExceeded | RequestCancelled):
        exc.locate(stage, request_id)
        return exc
    return StageError(stage, request_id, exc)


def status_of(error: BaseException | None) -> TraceStatus:
    if error is None:
        return TraceStatus.OK
    if isinstance(error, DeadlineExceeded):
        return TraceStatus.DEADLINE
    if isinstance(error, RequestCancelled):
        return TraceStatus.CANCELLED
    if isinstance(error, PipelineClosed):
        return TraceStatus.CLOSED
    return TraceStatus.ERROR


class RequestRun:
    """A submitted request: where it is, what it entered, how it ends. Loop-only.

    The request ends exactly once, in ``_finalize``: after the stage task running it and every
    child task have finished (failing cancels them first), ``Stage.cleanup`` runs for every
    entered stage in reverse order, the trace is recorded, the output channel is closed and
    ``done`` is resolved.
    """

    def __init__(
        self,
        ctx: RequestContext[Any],
        first_stage: str,
        *,
        tracer: Tracer,
        metrics: PipelineMetrics | None,
        cleanup_timeout_s: float,
        on_finished: Callable[[RequestRun], None],
    ) -> None:
        self.ctx = ctx
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.error: PipelineError | None = None
        self.trace: RequestTrace | None = None
        self.entered: list[Stage] = []
        self.position: str = first_stage
        self.in_stage = False
        self.queued_at = ctx.clock()
        self.fg_task: asyncio.Task[None] | None = None
        self._tracer = tracer
        self._metrics = metrics
        self._cleanup_timeout_s = cleanup_timeout_s
        self._on_finished = on_finished
        self._finalizer: asyncio.Task[None] | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None
        ctx.channel.bind(self.loop)

    def arm(self) -> None:
        """Start watching cancellation, the deadline and child tasks (call once, on submit)."""
        self.ctx.add_child_listener(self._child_done)
        remaining = self.ctx.remaining_s()
        if remaining is not None:
            self._deadline_timer = self.loop.call_later(max(0.0, remaining), self._deadline)
        self.ctx.add_cancel_listener(self._cancelled)

    @property
    def ending(self) -> bool:
        """True once the request failed or finished its last stage; workers drop it."""
        return self._finalizer is not None

    def enter(self, stage: Stage) -> None:
        """The foreground moved into ``stage`` (its task is about to be created)."""
        self.position = stage.name
        self.in_stage = True

    def began(self, stage: Stage) -> None:
        """``stage.run`` is starting (first line of its task): cleanup is now owed."""
        self.entered.append(stage)

    def wait_next(self, stage_name: str) -> None:
        self.position = stage_name
        self.in_stage = False
        self.queued_at = self.ctx.clock()

    def fail(self, error: PipelineError) -> None:
        """End the request with ``error`` (the first error wins); cancels its running tasks."""
        if self.error is not None or self.done.done():
            return
        self.error = error
        logger.debug("req=%s failed at stage=%s: %s", self.ctx.request_id, error.stage, error)
        if self._metrics is not None:
            cause = error.cause if isinstance(error, StageError) else error
            self._metrics.stage_errors.labels(error.stage or "none", type(cause).__name__).inc()
        if self.fg_task is not None and not self.fg_task.done():
            self.fg_task.cancel()
        for task in self.ctx.children().values():
            if not task.done():
                task.cancel()
        self._start_finalize()

    def last_stage_done(self) -> None:
        """The last foreground stage returned; end once the children are done."""
        self.in_stage = False
        self._start_finalize()

    def _start_finalize(self) -> None:
        if self._finalizer is None:
            self._finalizer = self.loop.create_task(
                self._finalize(), name=f"{self.ctx.request_id}:finalize"
            )

    async def _finalize(self) -> None:
        while True:
            pending = [t for t in self.ctx.children().values() if not t.done()]
            if self.fg_task is not None and not self.fg_task.done():
                pending.append(self.fg_task)
            if not pending:
                break
            await asyncio.wait(pending)
        # Child callbacks are scheduled with call_soon; let them report failures first.
        await asyncio.sleep(0)
        error = self.error
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        await self._cleanup(error)
        status = status_of(error)
        self.trace = self.ctx.to_trace(status, error)
        self._tracer.record(self.trace)
        if self._metrics is not None:
            self._metrics.requests.labels(str(status)).inc()
        self.ctx.channel.close(error)
        self.done.set_result(None)
        self._on_finished(self)

    async def _cleanup(self, error: BaseException | None) -> None:
        for stage in reversed(self.entered):
            try:
                await asyncio.wait_for(
                    stage.cleanup(self.ctx, error), timeout=self._cleanup_timeout_s
                )
            except TimeoutError:
                logger.error(
                    "req=%s cleanup of stage=%s timed out after %.3fs",
                    self.ctx.request_id,
                    stage.name,
                    self._cleanup_timeout_s,
                )
                self._count_cleanup_error(stage.name)
            except Exception:
                logger.exception(
                    "req=%s cleanup of stage=%s raised", self.ctx.request_id, stage.name
                )
                self._count_cleanup_error(stage.name)

    def _count_cleanup_error(self, stage: str) -> None:
        if self._metrics is not None:
            self._metrics.cleanup_errors.labels(stage).inc()

    def _deadline(self) -> None:
        if not self.ending:
            self.fail(
                DeadlineExceeded(self.position, self.ctx.request_id, queued=not self.in_stage)
            )

    def _cancelled(self, reason: str) -> None:
        # ctx.cancel may be called from any thread.
        if threading.get_ident() == self._loop_thread:
            self._cancel_now(reason)
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._cancel_now, reason)

    def _cancel_now(self, reason: str) -> None:
        if not self.ending:
            self.fail(RequestCancelled(reason, stage=self.position, request_id=self.ctx.request_id))

    def _child_done(self, name: str, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.fail(classify(exc, name, self.ctx.request_id))


class RequestHandle:
    """The caller's side of a submitted request.

    ``async for item in handle`` yields what the stages emit, in order, then stops when the
    request succeeds or raises its error (after every buffered item). One consumer only.
    ``await handle.result()`` waits for the end and returns the context, or raises the error:
    ``StageError`` (naming the stage; ``.cause`` is what it raised), a ``FinalError``
    subclass, ``DeadlineExceeded``, ``RequestCancelled`` or ``PipelineClosed``.
    """

    def __init__(self, run: RequestRun) -> None:
        self._run = run
        self.ctx = run.ctx
        self.request_id = run.ctx.request_id

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._items()

    async def _items(self) -> AsyncIterator[Any]:
        async for item in self.ctx.channel:
            yield item

    async def result(self) -> RequestContext[Any]:
        """Wait for the request to end; its context on success, else raise its error.

        Cancelling the awaiting task does not cancel the request (use ``cancel``).
        """
        await asyncio.shield(self._run.done)
        if self._run.error is not None:
            raise self._run.error
        return self.ctx

    def cancel(self, reason: str = "cancelled by caller") -> bool:
        """Cancel the request (thread-safe); False if it was already cancelled."""
        return self.ctx.cancel(reason)

    def done(self) -> bool:
        return self._run.done.done()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` on the event loop once the request has ended, whatever the ending
        (at once, soon, if it already has). For releasing what was taken for the request."""
        self._run.done.add_done_callback(lambda _: fn())

    @property
    def error(self) -> PipelineError | None:
        """The error the request ended with (None while running or on success)."""
        return self._run.error if self._run.done.done() else None

    @property
    def trace(self) -> RequestTrace | None:
        """The request's trace once it has ended."""
        return self._run.trace
