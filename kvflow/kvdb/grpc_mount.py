"""Mount a plain request -> response object on a grpc.Server or grpc.aio.Server.

kvdb's services do blocking work (the shard lock, SSD reads, evictions), so their logic is
written as ordinary methods ``Name(request) -> response`` that raise kvdb errors. This module
wraps them for either kind of server: on a sync server they run in its thread pool; on an
asyncio server each call runs in the event loop's default executor (``asyncio.to_thread``), so
the loop never blocks. Errors become gRPC statuses by ``status_for``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvflow.kvdb.errors import (
    AccessDeniedError,
    BlockPinnedError,
    InvalidRequestError,
    StoreClosedError,
    StoreFullError,
    UnknownShardError,
)

logger = logging.getLogger(__name__)

Handler = Callable[..., Any]
Metadata = Sequence[tuple[str, Any]] | None
CallerOf = Callable[[Metadata], Any]
"""The caller of one call from its invocation metadata (passed to the handler after the
request); AccessDeniedError refuses the call."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details for an error raised by a handler."""
    if isinstance(exc, UnknownShardError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, AccessDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, InvalidRequestError | ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, StoreClosedError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, BlockPinnedError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, StoreFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _log(name: str, code: grpc.StatusCode, exc: BaseException) -> None:
    if code is grpc.StatusCode.INTERNAL:
        logger.error("rpc=%s failed", name, exc_info=exc)
    else:
        logger.info("rpc=%s rejected: %s %s", name, code.name, exc)


def _sync_method(
    name: str, fn: Handler, caller: CallerOf | None
) -> Callable[[Any, Any, grpc.ServicerContext], Any]:
    def method(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            if caller is None:
                return fn(request)
            return fn(request, caller(context.invocation_metadata()))
        except Exception as exc:
            code, details = status_for(exc)
            _log(name, code, exc)
            context.abort(code, details)

    method.__name__ = name
    return method


def _aio_method(
    name: str, fn: Handler, caller: CallerOf | None
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Any]:
    async def method(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if caller is None:
                return await asyncio.to_thread(fn, request)
            who = caller(context.invocation_metadata())
            return await asyncio.to_thread(fn, request, who)
        except Exception as exc:
            code, details = status_for(exc)
            _log(name, code, exc)
            await context.abort(code, details)

    method.__name__ = name
    return method


def servicer_for(
    server: grpc.Server | grpc.aio.Server,
    core: object,
    base: type,
    methods: Sequence[str],
    caller: CallerOf | None = None,
) -> Any:
    """An instance of a subclass of the generated servicer ``base`` whose RPC ``methods``
    call ``core.<method>(request)`` (with ``caller``: ``core.<method>(request,
    caller(metadata))``), in the style ``server`` needs (sync or asyncio)."""
    wrap = _aio_method if isinstance(server, grpc.aio.Server) else _sync_method
    attrs = {name: wrap(name, getattr(core, name), caller) for name in methods}
    return type(f"{type(core).__name__}Servicer", (base,), attrs)()


def method_names(service_descriptor: Any) -> list[str]:
    """The RPC names of a service descriptor (``pb2.DESCRIPTOR.services_by_name[...]``)."""
    return [m.name for m in service_descriptor.methods]
