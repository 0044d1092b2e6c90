"""Malformed requests are INVALID_ARGUMENT, decided before any servicer runs, without a
traceback in the log.

gRPC deserializes a request with the message's ``FromString`` before the servicer sees it; a
payload that does not parse (truncated bytes, a string field with invalid UTF-8, a wrong wire
type) fails there, which gRPC logs with a traceback and answers INTERNAL/UNKNOWN. These
interceptors give every unary-request handler a deserializer that catches the failure, and a
behaviour that answers INVALID_ARGUMENT naming the method (logged at INFO, one line). Streaming
requests pass through unchanged (no RPC of kvflow streams requests).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc
from grpc import aio

logger = logging.getLogger(__name__)


class _Malformed:
    """What the tolerant deserializer returns for bytes that do not parse."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, UnicodeDecodeError, ...
            return _Malformed(f"{type(exc).__name__}: {exc}"[:200])

    return parse


def _details(method: str, bad: _Malformed) -> str:
    logger.info("malformed request to %s refused: %s", method, bad.error)
    return f"malformed request to {method}: {bad.error}"


def _rebuild(handler: grpc.RpcMethodHandler, unary: Any, stream: Any) -> grpc.RpcMethodHandler:
    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(
        stream if handler.response_streaming else unary,
        request_deserializer=_tolerant(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


def _aio_guard(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(method, request))
        return await handler.unary_unary(request, context)

    async def stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(method, request))
        result = handler.unary_stream(request, context)
        if inspect.isasyncgen(result):
            async for item in result:
                yield item
        else:  # a coroutine that writes with context.write
            await result

    return _rebuild(handler, unary, stream)


def _sync_guard(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(method, request))
        return handler.unary_unary(request, context)

    def stream(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(method, request))
        yield from handler.unary_stream(request, context)

    return _rebuild(handler, unary, stream)


class AioInputInterceptor(aio.ServerInterceptor):
    """For a ``grpc.aio`` server (module doc). Put it after any authentication interceptor."""

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        return _aio_guard(details.method, handler)


class InputInterceptor(grpc.ServerInterceptor):
    """For a synchronous ``grpc.server`` (module doc)."""

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        return _sync_guard(details.method, handler)
