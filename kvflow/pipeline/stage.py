"""The Stage contract: one step of the request path."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

from kvflow.pipeline.context import RequestContext


class Stage(ABC):
    """One step a request goes through. Knows nothing of how the pipeline schedules it.

    Class or instance attributes:
        name: unique within a pipeline; names the span, the metrics and the errors.
        concurrency: how many requests may be inside ``run`` at once (None: the pipeline's
            default; ``PipelineConfig.stage_concurrency`` overrides both).
        background: when True the pipeline starts ``run`` as a child task of the request and
            moves the request on to the next stage at once, so this stage overlaps the stages
            after it (e.g. stream overlapping prefill). The request ends only after it
            finishes; ``ctx.join(name)`` awaits it from a later stage. Its concurrency limit
            counts requests inside ``run``, and holds the request back when reached.

    Contract:
        ``run`` reads and mutates ``ctx.state``, may ``ctx.emit`` items, open ``ctx.span``s,
        ``ctx.spawn`` children and ``await`` blocking work run elsewhere (engine threads,
        executors). It must not block the event loop. It may be cancelled at any ``await``
        (request cancelled, deadline, pipeline stopped without drain).

        ``cleanup(ctx, error)`` is called once for every stage the request entered (whose
        ``run`` began executing), in reverse order of entry, when the request ends:
        ``error`` is None on success, else the error the request ended with. It runs after
        ``run`` (and every child) has returned or been cancelled, so it may release what
        ``run`` took (pages, pins) without racing it. It must tolerate a ``run`` that
        stopped half-way. Its exceptions are logged and counted, never raised; it is
        abandoned after ``PipelineConfig.cleanup_timeout_s``.
    """

    name: str = ""
    concurrency: int | None = None
    background: bool = False

    @abstractmethod
    async def run(self, ctx: RequestContext[Any]) -> None:
        """Do this stage's work for one request (mutates ``ctx.state``)."""

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:  # noqa: B027
        """Release what ``run`` took for ``ctx``; default: nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


RunFn = Callable[[RequestContext[Any]], Awaitable[None]]
CleanupFn = Callable[[RequestContext[Any], BaseException | None], Awaitable[None]]


class FunctionStage(Stage):
    """A stage made of plain async functions (small stages, tests, adapters)."""

    def __init__(
        self,
        name: str,
        run: RunFn,
        *,
        cleanup: CleanupFn | None = None,
        concurrency: int | None = None,
        background: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if concurrency is not None and (
            isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
        ):
            raise ValueError(f"concurrency must be an int >= 1 or None, got {concurrency!r}")
        self.name = name
        self._run = run
        self._cleanup = cleanup
        self.concurrency = concurrency
        self.background = background

    async def run(self, ctx: RequestContext[Any]) -> None:
        await self._run(ctx)

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        if self._cleanup is not None:
            await self._cleanup(ctx, error)
