"""Errors of the stage runtime.

Every error a request can end with carries ``stage`` (the stage that raised it, or the stage the
request was waiting for; ``None`` when it never reached one) and ``request_id``, so the caller
can say where a request failed without parsing messages.

How a request's error is formed from what a stage raised:

- an ordinary exception ``exc`` in stage X  -> ``StageError(X, request_id, exc)``; the server
  maps ``type(err.cause)`` to a status code;
- a ``FinalError`` subclass (e.g. a router's ``Rejected`` carrying data for RESOURCE_EXHAUSTED)
  -> passes through unwrapped, with ``stage`` and ``request_id`` filled in;
- ``DeadlineExceeded`` / ``RequestCancelled`` raised by a stage (``ctx.checkpoint()``) -> pass
  through, with ``stage`` filled in when the raiser left it empty.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Base of every error of kvflow.pipeline.

    Attributes:
        stage: the stage the error belongs to, or None.
        request_id: the request the error ended, or None.
    """

    def __init__(
        self, message: str, *, stage: str | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.request_id = request_id

    def locate(self, stage: str, request_id: str) -> None:
        """Fill ``stage`` and ``request_id`` where they are still unknown (mutates self)."""
        if self.stage is None:
            self.stage = stage
        if self.request_id is None:
            self.request_id = request_id


class StageError(PipelineError):
    """A stage raised an ordinary exception.

    Attributes:
        stage: name of the stage that raised.
        request_id: the request it was running.
        cause: the exception the stage raised (also ``__cause__``); map its type to a status.
    """

    def __init__(self, stage: str, request_id: str, cause: BaseException) -> None:
        super().__init__(
            f"stage {stage!r} failed for request {request_id!r}: {type(cause).__name__}: {cause}",
            stage=stage,
            request_id=request_id,
        )
        self.cause = cause
        self.__cause__ = cause

    def __reduce__(self) -> tuple[type[StageError], tuple[str, str, BaseException]]:
        return (StageError, (self.stage or "", self.request_id or "", self.cause))


class FinalError(PipelineError):
    """Base for errors that end a request with an answer meant for the caller.

    Subclass it (``class Rejected(FinalError)``) to carry data, e.g. why the router refused a
    request. The runtime does not wrap it in ``StageError``; it fills ``stage`` and
    ``request_id`` and hands it to ``RequestHandle.result()`` as is.
    """


class DeadlineExceeded(PipelineError):
    """The request's deadline passed while it ran (or waited for) ``stage``."""

    def __init__(
        self, stage: str | None = None, request_id: str | None = None, *, queued: bool = False
    ) -> None:
        where = "while queued for" if queued else "in"
        super().__init__(
            f"deadline exceeded {where} stage {stage!r} (request {request_id!r})",
            stage=stage,
            request_id=request_id,
        )
        self.queued = queued

    def __str__(self) -> str:
        where = "while queued for" if self.queued else "in"
        return f"deadline exceeded {where} stage {self.stage!r} (request {self.request_id!r})"


class RequestCancelled(PipelineError):
    """The request was cancelled (``ctx.cancel(reason)`` or ``handle.cancel()``).

    Attributes:
        reason: the reason given to ``cancel``.
    """

    def __init__(
        self, reason: str = "cancelled", *, stage: str | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(reason, stage=stage, request_id=request_id)
        self.reason = reason

    def __str__(self) -> str:
        return f"request {self.request_id!r} cancelled in stage {self.stage!r}: {self.reason}"


class PipelineClosed(PipelineError):
    """The pipeline is not running: not started, stopping, or stopped before the request ended."""


class Overloaded(PipelineError):
    """``try_submit`` found the first queue full; the caller should shed the request."""

    def __init__(self, queue_size: int) -> None:
        super().__init__(f"pipeline overloaded: first queue is full ({queue_size} waiting)")
        self.queue_size = queue_size
