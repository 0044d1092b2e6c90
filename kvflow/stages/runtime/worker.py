"""EngineWorker: the one thread that owns an engine and runs its step() loop.

The engine is not thread-safe, so every touch of it happens here: requests are added, aborted
and released through a command queue, and each step's outputs are handed to the sink that
was registered with the request — *on the engine thread*, so a sink may export pages of its
request right away (the page cannot be freed under it). Sinks must be quick and must not
block; they typically hand data to asyncio with ``loop.call_soon_threadsafe``.

While the engine has nothing to run the thread may do bounded chores for the process
(``add_idle_task``): each call a small piece (the kvdb DRAM tier's write-ahead maps 2 MiB,
``kvdb/dram.py``), the command queue looked at between pieces, so a request arriving then
waits for one piece at most. They start only once the engine has been idle for
``IDLE_GRACE_S``: a client that sends its next request as soon as the last one is answered
finds the thread waiting, not busy.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvflow.stages.engine import Engine, RequestOutput, SamplingParams, UnknownRequestError
from kvflow.stages.engine.openmp import SpinControl, default_threads, set_thread_count, waiting
from kvflow.stages.runtime.step_trace import StepTrace
from kvflow.stages.runtime.threads import EngineThreads

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_GRACE_S = 0.05
"""How long the engine must have been idle before the idle tasks run."""

Sink = Callable[[Engine, RequestOutput], None]
ErrorSink = Callable[[BaseException], None]
# Given a request's last output (on the engine thread): the work item that continues it, or None.
Continuation = Callable[[Engine, RequestOutput], "WorkItem | None"]


@dataclass
class WorkItem:
    """One request for the engine. ``prefix_pages`` are copied into the pool on admission,
    or ``adopt_from`` names a finished retained request of the same engine whose pages it
    takes over in place (``Engine.add_request``); ``on_admitted(engine)`` then runs on the
    engine thread (so it may export pages). ``then(engine, output)``: called on the engine
    thread when the request finishes (not aborted), after its sink took the last output; the
    work item it returns is admitted at once, so it is in the very next step (a colocated
    decode continues its prefill so, adopting its pages). It must not raise: its errors
    belong to the item it would return."""

    request_id: str
    token_ids: Sequence[int]
    sampling: SamplingParams
    sink: Sink
    on_error: ErrorSink
    prefix_pages: Sequence[Any] = ()
    num_prefix_tokens: int = 0
    retain_pages: bool = False
    verify_pages: bool = True
    num_output_tokens: int = 0
    block_keys: Sequence[Any] = ()  # of full prompt blocks: pages shared by key (engine.py)
    adopt_from: str | None = None
    on_admitted: Callable[[Engine], None] | None = field(default=None)
    then: Continuation | None = None


class WorkerStopped(RuntimeError):
    """The worker was stopped; the request was not run."""


class EngineWorker:
    """Runs ``engine.step()`` in a dedicated thread. All public methods are thread-safe."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        idle_wait_s: float = 1.0,
        intra_op_threads: int | EngineThreads | None = None,
    ) -> None:
        """``intra_op_threads``: torch's intra-op threads for this engine's forward passes
        (set on the worker thread before each step; ``runtime/threads.py`` decides); an int
        is a fixed count; None: the process's default (``openmp.default_threads``). How
        the threads wait at barriers follows the steps' CPU share (``engine/openmp.py``).
        ``idle_wait_s``: how long an idle loop waits for a command before it looks at the
        stop flag again (every command, ``stop`` included, wakes it at once; a short wait
        only burns an idle server's CPU)."""
        self.name = name
        self.engine = engine
        if isinstance(intra_op_threads, int):
            intra_op_threads = EngineThreads(intra_op_threads)
        self.threads = intra_op_threads
        self._thread_count: int | None = None  # what this thread's torch is set to
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sinks: dict[str, WorkItem] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._steps = 0
        self._lock = threading.Lock()
        self._trace: StepTrace | None = None  # KVFLOW_STEP_TRACE (step_trace.py)
        self._spin: SpinControl | None = None  # made on the engine thread
        self._idle_tasks: list[Callable[[], int]] = []
        self._busy_until = 0.0  # when the engine last had work or a command (monotonic)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still running get ``WorkerStopped``. Idempotent."""
        self._stop.set()
        self._commands.put(lambda: None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        for item in list(self._sinks.values()):
            _safe_call(item.on_error, WorkerStopped(f"engine worker {self.name} stopped"))
        self._sinks.clear()

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def num_active(self) -> int:
        """Requests admitted and not yet finished (approximate, lock-free read)."""
        return len(self._sinks)

    def add_idle_task(self, task: Callable[[], int]) -> None:
        """Run ``task()`` on the engine thread while the engine is idle (and has been for
        ``IDLE_GRACE_S``), again while it returns a positive amount of work done, and else
        after the idle wait (a second).
        It must do a small piece per call; an exception logs and drops it. Safe to call from
        any thread, before or after ``start``."""
        self._idle_tasks.append(task)

    def _idle_work(self) -> bool:
        """One piece of each idle task; whether any did work."""
        worked = False
        for task in list(self._idle_tasks):
            try:
                worked = task() > 0 or worked
            except Exception:
                logger.exception("worker=%s idle task %r failed; dropped", self.name, task)
                self._idle_tasks.remove(task)
        return worked

    # -- commands -------------------------------------------------------------------------
    def submit(self, item: WorkItem) -> None:
        """Queue a request. Validation errors from the engine reach ``item.on_error``."""
        if self._stop.is_set():
            raise WorkerStopped(f"engine worker {self.name} is stopped")
        self._commands.put(lambda: self._admit(item))

    def abort(self, request_id: str) -> None:
        """Abort a queued or running request; its pages are freed. Unknown ids are ignored."""
        self._commands.put(lambda: self._abort(request_id))

    def drop(self, request_id: str) -> concurrent.futures.Future[None]:
        """Abort the request if it runs and release its retained pages; unknown ids are fine.
        Returns a future that is done once the engine forgot it."""

        def drop(engine: Engine) -> None:
            try:
                engine.abort(request_id)
                engine.release(request_id)
            except UnknownRequestError:
                pass

        self.abort(request_id)
        return self.call(drop)

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps; returns a future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:
                fut.set_exception(exc)

        if self._stop.is_set():
            fut.set_exception(WorkerStopped(f"engine worker {self.name} is stopped"))
        else:
            self._commands.put(command)
        return fut

    # -- the loop -------------------------------------------------------------------------
    def _admit(self, item: WorkItem) -> None:
        try:
            self.engine.add_request(
                item.request_id,
                item.token_ids,
                item.sampling,
                prefix_pages=item.prefix_pages,
                num_prefix_tokens=item.num_prefix_tokens,
                retain_pages=item.retain_pages,
                verify_pages=item.verify_pages,
                num_output_tokens=item.num_output_tokens,
                block_keys=item.block_keys,
                adopt_from=item.adopt_from,
            )
        except Exception as exc:
            _safe_call(item.on_error, exc)
            return
        self._sinks[item.request_id] = item
        if self._trace is not None:
            self._trace.admitted(item.request_id)
        if item.on_admitted is not None:
            _safe_call(item.on_admitted, self.engine)

    def _abort(self, request_id: str) -> None:
        item = self._sinks.pop(request_id, None)
        if item is None:
            return
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("worker=%s req=%s abort failed", self.name, request_id)

    def _drain_commands(self, block: bool, timeout: float | None = None) -> None:
        """Run the queued commands; with ``block``, wait for the first one up to
        ``timeout`` (None: the idle wait)."""
        try:
            wait = self._idle_wait_s if timeout is None else timeout
            cmd = self._commands.get(timeout=wait) if block else None
        except queue.Empty:
            return
        self._busy_until = time.monotonic()
        while True:
            if cmd is not None:
                try:
                    cmd()
                except Exception:
                    logger.exception("worker=%s command failed", self.name)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _set_threads(self) -> None:
        """Set this thread's intra-op count for the next step (only when it changes)."""
        n = default_threads() if self.threads is None else self.threads.for_step()
        if n != self._thread_count:
            set_thread_count(n)  # this thread's parallel regions only
            self._thread_count = n

    def _stepping(self) -> AbstractContextManager[None]:
        marks = self.threads.marks if self.threads is not None else None
        return nullcontext() if marks is None else marks.stepping()

    def _loop(self) -> None:
        self._trace = StepTrace.from_env(self.name)
        target = waiting()
        self._spin = None if target is None else SpinControl(target)
        try:
            self._run_loop()
        finally:
            if self._trace is not None:
                self._trace.close()
            if self._spin is not None:
                self._spin.close()

    def _run_loop(self) -> None:
        trace = self._trace
        self._set_threads()
        logger.info(
            "worker=%s engine loop started (%d intra-op threads)",
            self.name,
            torch.get_num_threads(),
        )
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            if idle and self._idle_tasks and self._commands.empty():
                waited = time.monotonic() - self._busy_until
                if waited < IDLE_GRACE_S:  # just idle: a next request may be on its way
                    self._drain_commands(block=True, timeout=IDLE_GRACE_S - waited)
                    continue
                if self._idle_work():
                    continue  # more to do: look at the commands again first
            self._drain_commands(block=idle)
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            self._set_threads()
            started, cpu_started = time.perf_counter(), time.thread_time()
            if trace is not None:
                trace.begin(started, cpu_started)
            try:
                with self._stepping():
                    outputs = self.engine.step()
            except Exception as exc:
                logger.exception("worker=%s engine step failed; failing its requests", self.name)
                self._fail_all(exc)
                continue
            stepped, cpu = time.perf_counter(), time.thread_time()
            if self._spin is not None:
                self._spin.step(cpu - cpu_started, stepped - started)
            self._steps += 1
            continuations = self._hand_on(outputs)
            if trace is not None:
                trace.end(self.engine.last_plan, stepped, cpu, outputs)
            for item in continuations:  # before the next step, which then runs them
                self._admit(item)
            self._busy_until = time.monotonic()
        logger.info("worker=%s engine loop stopped after %d steps", self.name, self._steps)

    def _hand_on(self, outputs: list[RequestOutput]) -> list[WorkItem]:
        """Give each output to its request's sink; returns the work items that continue the
        requests that finished (``WorkItem.then``)."""
        continuations: list[WorkItem] = []
        for out in outputs:
            item = self._sinks.get(out.request_id)
            if item is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            try:
                item.sink(self.engine, out)
            except Exception as exc:
                logger.exception("worker=%s req=%s sink failed", self.name, out.request_id)
                if not out.finished:
                    self._abort(out.request_id)
                _safe_call(item.on_error, exc)
                continue
            if out.finished and out.finish_reason != "abort" and item.then is not None:
                try:
                    follower = item.then(self.engine, out)
                except Exception:
                    logger.exception(
                        "worker=%s req=%s continuation failed", self.name, out.request_id
                    )
                    continue
                if follower is not None:
                    continuations.append(follower)
        return continuations

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, item in list(self._sinks.items()):
            self._abort(request_id)
            _safe_call(item.on_error, exc)


def _safe_call(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        logger.exception("callback %r failed", fn)
