"""The request context: what flows through the stages of a pipeline.

One ``RequestContext`` per request. It holds the request id, its clock and deadline, its
cancellation flag, ``state`` (the stages' data; any object, a ``SimpleNamespace`` by default),
the output channel stages ``emit`` into, the spans recorded so far, and the child tasks stages
``spawn``. A context can be used without a pipeline (stage unit tests): spans, emit, spawn and
checkpoints all work on their own.

Thread-safety: ``cancel``, ``emit``, ``span``/``set_attr`` and the read-only properties may be
called from any thread (an engine thread, an executor). ``spawn``/``join`` need the event loop.
``state`` is not guarded: stages of one request that run at once must agree on who writes what.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Generic, TypeVar

from kvflow.pipeline.channel import OutputChannel
from kvflow.pipeline.errors import DeadlineExceeded, RequestCancelled
from kvflow.pipeline.spans import RequestTrace, Span, TraceStatus

logger = logging.getLogger(__name__)

StateT = TypeVar("StateT")
Clock = Callable[[], float]
CancelListener = Callable[[str], None]
ChildListener = Callable[[str, "asyncio.Task[Any]"], None]

_context_ids = itertools.count(1)


@dataclass(frozen=True)
class _Frame:
    """Which span of which context the running code is inside (kept in a ContextVar)."""

    context_id: int
    span_id: int
    stage_span_id: int
    stage: str


_FRAME: contextvars.ContextVar[_Frame | None] = contextvars.ContextVar(
    "kvflow_pipeline_frame", default=None
)


@dataclass
class _OpenSpan:
    name: str
    start_s: float
    attrs: dict[str, Any]
    parent: int | None
    stage: str


class SpanHandle:
    """An open span; ``set_attr`` adds attributes until it closes. Thread-safe."""

    def __init__(self, ctx: RequestContext[Any], span_id: int, name: str) -> None:
        self._ctx = ctx
        self.span_id = span_id
        self.name = name

    def set_attr(self, key: str, value: Any) -> None:
        self._ctx._set_span_attr(self.span_id, key, value)

    def set_attrs(self, **attrs: Any) -> None:
        for key, value in attrs.items():
            self.set_attr(key, value)


class RequestContext(Generic[StateT]):
    """One request's context. See the module docstring for the thread-safety contract.

    Args:
        request_id: a non-empty id; a random hex id when None.
        state: the stages' data; a fresh ``SimpleNamespace`` when None.
        deadline: absolute deadline in seconds of ``clock``; None for none.
        timeout_s: alternative to ``deadline``: seconds from now (> 0).
        clock: the time source (monotonic seconds); inject a fake one in tests.
    """

    def __init__(
        self,
        request_id: str | None = None,
        *,
        state: StateT | None = None,
        deadline: float | None = None,
        timeout_s: float | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if request_id is None:
            request_id = uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if deadline is not None and timeout_s is not None:
            raise ValueError("give deadline or timeout_s, not both")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.request_id = request_id
        self.clock = clock
        self.created = clock()
        self.deadline: float | None = (
            self.created + timeout_s if timeout_s is not None else deadline
        )
        self.state: StateT = state if state is not None else SimpleNamespace()  # type: ignore[assignment]
        self.channel = OutputChannel()
        self._id = next(_context_ids)
        self._lock = threading.Lock()
        self._cancel_reason: str | None = None
        self._cancel_listeners: list[CancelListener] = []
        self._child_listeners: list[ChildListener] = []
        self._children: dict[str, asyncio.Task[Any]] = {}
        self._span_ids = itertools.count(1)
        self._open: dict[int, _OpenSpan] = {}
        self._finished: list[Span] = []
        self._attrs: dict[str, Any] = {}
        # Set by the pipeline that accepted this context; a context runs in one pipeline once.
        self._owner: object | None = None

    def __repr__(self) -> str:
        return f"RequestContext(request_id={self.request_id!r})"

    # -- time -------------------------------------------------------------------------------

    def now(self) -> float:
        """The context's clock."""
        return self.clock()

    def remaining_s(self) -> float | None:
        """Seconds until the deadline (negative when past), or None without a deadline."""
        return None if self.deadline is None else self.deadline - self.clock()

    @property
    def expired(self) -> bool:
        remaining = self.remaining_s()
        return remaining is not None and remaining <= 0

    # -- cancellation -----------------------------------------------------------------------

    def cancel(self, reason: str = "cancelled") -> bool:
        """Mark the request cancelled; True for the first call, False if already cancelled.

        Thread-safe. A pipeline running the request cancels the stage running it at once; a
        stage that polls raises ``RequestCancelled`` at its next ``checkpoint()``.
        """
        with self._lock:
            if self._cancel_reason is not None:
                return False
            self._cancel_reason = reason
            listeners = list(self._cancel_listeners)
        for listener in listeners:
            try:
                listener(reason)
            except Exception:
                logger.exception("req=%s cancel listener failed", self.request_id)
        return True

    @property
    def cancelled(self) -> bool:
        return self._cancel_reason is not None

    @property
    def cancel_reason(self) -> str | None:
        return self._cancel_reason

    def checkpoint(self) -> None:
        """Raise ``RequestCancelled`` if cancelled, ``DeadlineExceeded`` if past the deadline."""
        frame = self._frame()
        stage = frame.stage if frame is not None else None
        if self._cancel_reason is not None:
            raise RequestCancelled(self._cancel_reason, stage=stage, request_id=self.request_id)
        if self.expired:
            raise DeadlineExceeded(stage, self.request_id)

    def add_cancel_listener(self, listener: CancelListener) -> None:
        """Call ``listener(reason)`` on cancellation (at once if already cancelled)."""
        with self._lock:
            reason = self._cancel_reason
            if reason is None:
                self._cancel_listeners.append(listener)
        if reason is not None:
            listener(reason)

    def remove_cancel_listener(self, listener: CancelListener) -> None:
        with self._lock:
            if listener in self._cancel_listeners:
                self._cancel_listeners.remove(listener)

    # -- output -----------------------------------------------------------------------------

    def emit(self, item: Any) -> bool:
        """Send ``item`` to the request's output stream (``async for item in handle``).

        Thread-safe, never blocks; ownership of ``item`` passes to the consumer. Returns False
        when the request has already ended (the item is dropped).
        """
        return self.channel.put(item)

    # -- spans ------------------------------------------------------------------------------

    @contextmanager
    def span(self, name: str, **attrs: Any) -> Iterator[SpanHandle]:
        """Time a child span of the current span (or a top-level one outside any span).

        On an exception the span records ``error`` (the exception type) and re-raises.
        """
        frame = self._frame()
        parent = frame.span_id if frame is not None else None
        stage = frame.stage if frame is not None else name
        stage_span = frame.stage_span_id if frame is not None else None
        with self._scope(name, attrs, parent, stage, stage_span) as handle:
            yield handle

    @contextmanager
    def stage_span(self, stage: str, **attrs: Any) -> Iterator[SpanHandle]:
        """Open a top-level span for ``stage``; code inside is "in" that stage.

        The pipeline opens one around every ``Stage.run``; ``set_attr`` and ``checkpoint``
        inside refer to it. Use it directly to run a stage without a pipeline.
        """
        with self._scope(stage, attrs, None, stage, None) as handle:
            yield handle

    def set_attr(self, key: str, value: Any) -> None:
        """Set an attribute on the current stage's span (the request's attrs outside one)."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"attribute key must be a non-empty str, got {key!r}")
        frame = self._frame()
        if frame is None:
            with self._lock:
                self._attrs[key] = value
            return
        self._set_span_attr(frame.stage_span_id, key, value)

    def set_attrs(self, **attrs: Any) -> None:
        for key, value in attrs.items():
            self.set_attr(key, value)

    def spans(self) -> tuple[Span, ...]:
        """The finished spans so far, in opening order."""
        with self._lock:
            return tuple(sorted(self._finished, key=lambda s: s.span_id))

    def current_stage(self) -> str | None:
        """The stage the calling code runs in (from the task's context), or None."""
        frame = self._frame()
        return frame.stage if frame is not None else None

    def to_trace(self, status: TraceStatus, error: BaseException | None) -> RequestTrace:
        """Close any span still open (marked ``unfinished``) and return the request's trace."""
        now = self.clock()
        with self._lock:
            for span_id, open_span in list(self._open.items()):
                open_span.attrs["unfinished"] = True
                self._finished.append(self._close_locked(span_id, open_span, now))
            self._open.clear()
            spans = tuple(sorted(self._finished, key=lambda s: s.span_id))
            attrs = dict(self._attrs)
        text = None if error is None else f"{type(error).__name__}: {error}"
        return RequestTrace(self.request_id, spans, status, text, attrs)

    # -- child tasks ------------------------------------------------------------------------

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` concurrently as a child of this request, in its own span lane ``name``.

        Use it to overlap work of one request (e.g. stream KV while prefill runs). Under a
        pipeline the request does not finish before every child has; an exception in a child
        fails the request with an error naming ``name``; a failing or cancelled request cancels
        its children. ``join(name)`` awaits one. Names must be unique among running children.
        Must be called on the event loop.
        """
        if not isinstance(name, str) or not name:
            coro.close()
            raise ValueError(f"child name must be a non-empty str, got {name!r}")
        existing = self._children.get(name)
        if existing is not None and not existing.done():
            coro.close()
            raise ValueError(f"req={self.request_id}: a child named {name!r} is still running")

        async def child() -> Any:
            with self.stage_span(name):
                return await coro

        task = asyncio.get_running_loop().create_task(child(), name=f"{self.request_id}:{name}")
        self._children[name] = task
        task.add_done_callback(lambda done: self._child_done(name, done))
        # A task cancelled before its first step never awaits ``coro``: close it (no warning).
        task.add_done_callback(lambda _: _close_unstarted(coro))
        if self.cancelled:
            task.cancel()
        return task

    async def join(self, name: str) -> Any:
        """Await the child ``name`` and return its result (or raise its exception).

        Cancelling the joiner does not cancel the child. Raises KeyError for an unknown name.
        """
        task = self._children.get(name)
        if task is None:
            raise KeyError(f"req={self.request_id}: no child named {name!r}")
        return await asyncio.shield(task)

    def children(self) -> dict[str, asyncio.Task[Any]]:
        """A copy of name -> task of every child spawned so far."""
        return dict(self._children)

    def add_child_listener(self, listener: ChildListener) -> None:
        """Call ``listener(name, task)`` whenever a child task finishes (on the loop)."""
        self._child_listeners.append(listener)

    # -- internals --------------------------------------------------------------------------

    def _frame(self) -> _Frame | None:
        frame = _FRAME.get()
        return frame if frame is not None and frame.context_id == self._id else None

    @contextmanager
    def _scope(
        self,
        name: str,
        attrs: dict[str, Any],
        parent: int | None,
        stage: str,
        stage_span: int | None,
    ) -> Iterator[SpanHandle]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"span name must be a non-empty str, got {name!r}")
        span_id = next(self._span_ids)
        with self._lock:
            self._open[span_id] = _OpenSpan(name, self.clock(), dict(attrs), parent, stage)
        token = _FRAME.set(
            _Frame(self._id, span_id, span_id if stage_span is None else stage_span, stage)
        )
        try:
            yield SpanHandle(self, span_id, name)
        except BaseException as exc:
            with self._lock:
                open_span = self._open.get(span_id)
                if open_span is not None:  # None: force-closed by to_trace meanwhile
                    open_span.attrs["error"] = type(exc).__name__
            raise
        finally:
            _FRAME.reset(token)
            now = self.clock()
            with self._lock:
                open_span = self._open.pop(span_id, None)
                if open_span is not None:
                    self._finished.append(self._close_locked(span_id, open_span, now))

    def _close_locked(self, span_id: int, open_span: _OpenSpan, now: float) -> Span:
        return Span(
            name=open_span.name,
            start_s=open_span.start_s,
            duration_s=max(0.0, now - open_span.start_s),
            attrs=open_span.attrs,
            parent=open_span.parent,
            span_id=span_id,
            stage=open_span.stage,
        )

    def _set_span_attr(self, span_id: int, key: str, value: Any) -> None:
        with self._lock:
            open_span = self._open.get(span_id)
            if open_span is None:
                raise RuntimeError(
                    f"req={self.request_id}: span {span_id} is closed; cannot set {key!r}"
                )
            open_span.attrs[key] = value

    def _child_done(self, name: str, task: asyncio.Task[Any]) -> None:
        for listener in list(self._child_listeners):
            try:
                listener(name, task)
            except Exception:
                logger.exception("req=%s child listener failed", self.request_id)


def _close_unstarted(coro: Coroutine[Any, Any, Any]) -> None:
    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()
