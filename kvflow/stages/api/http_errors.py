"""HTTP errors in OpenAI's JSON shape (SGLang's server uses the same), and the one mapping from
a request's error to an HTTP status.

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": 400}}

| error | status |
| --- | --- |
| bad input (InvalidArgument, malformed JSON, wrong types, bad UTF-8) | 400 |
| no valid API key where keys are configured (api/auth.py) | 401 |
| unknown model or route | 404 |
| body over the limit | 413 |
| the conductor rejects it (TTFT/TBT SLO) | 429 with Retry-After |
| the tenant is over a limit (RateLimited: concurrency, rate) | 429 with Retry-After |
| the admission queue is full, or the wait in it too long (QueueFull) | 429 with Retry-After |
| no capacity after the first token, shutting down | 503 with Retry-After |
| deadline exceeded | 504 |
| the client went away before a non-streaming answer (nobody reads it) | 499 |
| anything else (a stage failed) | 500 |
"""

from __future__ import annotations

import math
from typing import Any

from fastapi.responses import JSONResponse

from kvflow.pipeline import DeadlineExceeded, Overloaded, PipelineClosed, QueueFull, StageError
from kvflow.stages.errors import InvalidArgument, NoCapacity, RateLimited, Rejected

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class HttpError(Exception):
    """An error answer: ``status``, ``message``, optional ``param`` and extra ``headers``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _retry_after(error: Rejected) -> str:
    """Seconds until the rejected request could plausibly be served: the predicted queue
    of the instance it would have gone to (at least 1)."""
    rejection = getattr(error, "rejection", None)
    queue = getattr(rejection, "t_queue", None)
    if queue is None or not math.isfinite(queue):
        return "1"
    return str(max(1, math.ceil(queue)))


def http_error_for(error: BaseException) -> HttpError:
    """The HTTP answer for the error a request ended with (the table above)."""
    if isinstance(error, HttpError):
        return error
    if isinstance(error, InvalidArgument):
        return HttpError(400, str(error))
    if isinstance(error, Rejected):
        return HttpError(429, str(error), headers={"Retry-After": _retry_after(error)})
    if isinstance(error, RateLimited):
        retry = str(max(1, math.ceil(error.retry_after_s)))
        return HttpError(429, str(error), headers={"Retry-After": retry})
    if isinstance(error, QueueFull):
        return HttpError(429, str(error), headers={"Retry-After": str(int(error.retry_after_s))})
    if isinstance(error, Overloaded | NoCapacity | PipelineClosed):
        return HttpError(503, str(error), headers={"Retry-After": "1"})
    if isinstance(error, DeadlineExceeded):
        return HttpError(504, str(error))
    if isinstance(error, StageError):
        return HttpError(500, f"stage {error.stage}: {error.cause!r}")
    return HttpError(500, f"{type(error).__name__}: {error}")
