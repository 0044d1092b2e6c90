"""Errors the stages end a request with. The service maps each to a gRPC status code."""

from __future__ import annotations

from kvflow.pipeline import FinalError
from kvflow.router import Rejection


class InvalidArgument(FinalError):
    """The request itself is wrong (empty prompt, too long, bad sampling, bad tenant):
    INVALID_ARGUMENT. The message names the field."""


class Rejected(FinalError):
    """The conductor could not meet the TTFT or TBT SLO: RESOURCE_EXHAUSTED (HTTP 429 in the
    paper). ``rejection`` carries the predictions."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message())
        self.rejection = rejection


class NoCapacity(FinalError):
    """No engine has room for the request right now (KV pages, staging slots):
    RESOURCE_EXHAUSTED."""


class RateLimited(FinalError):
    """The tenant is over one of its limits (``limit``: the config field's name, e.g.
    ``tenant_max_concurrency``): RESOURCE_EXHAUSTED, HTTP 429 with Retry-After
    (``retry_after_s``, when it could be admitted again)."""

    def __init__(self, message: str, limit: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s


def engine_error(exc: BaseException, instance_id: str) -> BaseException:
    """Map an engine's refusal of a request to the error the caller should see."""
    from kvflow.stages.engine import InvalidRequestError, OutOfPagesError

    if isinstance(exc, OutOfPagesError):
        return NoCapacity(f"instance {instance_id}: {exc}")
    if isinstance(exc, InvalidRequestError):
        return InvalidArgument(f"instance {instance_id}: {exc}")
    return exc


class StreamTargetFailed(RuntimeError):
    """The decode side of a request's KV stream did not take its pages in time (it timed
    out, is unreachable, or its circuit breaker is open because it did recently): ABORTED
    on the node API, which the router's node client turns into NodeCallFailed for the
    *decode* node (``peer``: its transfer address), so the request is routed again around
    it rather than around the prefill node that reported it."""

    def __init__(self, peer: str, details: str) -> None:
        super().__init__(f"stream target {peer}: {details}")
        self.peer = peer


class NodeCallFailed(RuntimeError):
    """A call to another node failed in a way a retry elsewhere can fix (the node died,
    timed out or broke): the router marks ``node`` failed and routes the request again."""

    def __init__(self, node: object, details: str) -> None:
        super().__init__(details)
        self.node = node


class NodeBusy(RuntimeError):
    """A node refused a call for lack of room (RESOURCE_EXHAUSTED: no staging or KV pages, its
    queue full): backpressure, not a failure. The router tries the next-best node of that
    kind for the request and, when every one is busy, the request waits in the router's
    admission queue (NoCapacity); the node is not marked failed."""

    def __init__(self, node: object, details: str) -> None:
        super().__init__(details)
        self.node = node
