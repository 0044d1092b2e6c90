"""gRPC between kvflow processes: a token derived from the cluster secret, in metadata.

Why a token and not mTLS: a cluster already shares one secret (Raft needs it for pysyncobj's
password, the transfer engine for its handshake), so a token derived from it costs no PKI —
no CA, no per-node certificates to issue, rotate or revoke — and one metadata comparison per
call (the benchmark ``kvflow.tools.bench.auth`` measures it). The token is sent in clear over
an insecure channel: on 127.0.0.1, the threat model of docs/security.md (a local user without root),
nobody can read loopback traffic. A cluster spread over an untrusted network adds TLS under
the token (``security/tls.py``: ``--tls-cert/--tls-key`` on servers, ``--tls-ca`` on
clients); the channels below carry the same metadata over it.

``CLUSTER_TOKEN_KEY`` carries the token; servers built with :func:`cluster_interceptors` answer
UNAUTHENTICATED, before the servicer runs, to a call without the right one. Clients open
channels with :func:`cluster_channel` / :func:`cluster_aio_channel`.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc import aio

from kvflow.security.grpc_input import AioInputInterceptor, InputInterceptor
from kvflow.security.secret import ClusterSecret
from kvflow.security.tls import TlsSettings, aio_channel, channel

CLUSTER_TOKEN_KEY = "x-kvflow-cluster-token"
"""The metadata key of the cluster token (lower case, as gRPC requires)."""

Metadata = Sequence[tuple[str, str | bytes]]


def token_of(metadata: Metadata | None) -> str | None:
    """The cluster token in ``metadata``, if any."""
    for key, value in metadata or ():
        if key == CLUSTER_TOKEN_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return None


def has_cluster_token(metadata: Metadata | None, secret: ClusterSecret) -> bool:
    """Whether ``metadata`` carries ``secret``'s token (constant-time comparison)."""
    token = token_of(metadata)
    return token is not None and hmac.compare_digest(token, secret.grpc_token())


# --- servers ------------------------------------------------------------------------------

_DENIED = "this kvflow port needs the cluster secret"


def _sync_denier(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    def deny_stream(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
        yield  # pragma: no cover - abort raises

    return _handler_like(handler, deny, deny_stream)


def _aio_denier(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    async def deny_stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
        yield  # pragma: no cover - abort raises

    return _handler_like(handler, deny, deny_stream)


def _handler_like(
    handler: grpc.RpcMethodHandler, unary: Callable[..., Any], stream: Callable[..., Any]
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind whose behaviour is ``unary``/``stream`` (the request
    is never deserialized: it is dropped as bytes)."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class ClusterOnlyInterceptor(grpc.ServerInterceptor):
    """A synchronous server's gate: only calls that carry the cluster token reach a servicer."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._secret = secret

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or has_cluster_token(details.invocation_metadata, self._secret):
            return handler
        return _sync_denier(handler)


class AioClusterOnlyInterceptor(aio.ServerInterceptor):
    """The same gate for a ``grpc.aio`` server."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._secret = secret

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or has_cluster_token(details.invocation_metadata, self._secret):
            return handler
        return _aio_denier(handler)


def cluster_interceptors(secret: ClusterSecret | None) -> list[grpc.ServerInterceptor]:
    """Interceptors for a synchronous intra-cluster server: the token gate (not when running
    open), then malformed requests → INVALID_ARGUMENT (``grpc_input``)."""
    gate: list[grpc.ServerInterceptor] = [] if secret is None else [ClusterOnlyInterceptor(secret)]
    return [*gate, InputInterceptor()]


def aio_cluster_interceptors(secret: ClusterSecret | None) -> list[aio.ServerInterceptor]:
    """Interceptors for a ``grpc.aio`` intra-cluster server (as ``cluster_interceptors``)."""
    gate: list[aio.ServerInterceptor] = []
    if secret is not None:
        gate.append(AioClusterOnlyInterceptor(secret))
    return [*gate, AioInputInterceptor()]


# --- clients ------------------------------------------------------------------------------


def _with_token(metadata: Metadata | None, token: str) -> list[tuple[str, str | bytes]]:
    out = [(k, v) for k, v in (metadata or ()) if k != CLUSTER_TOKEN_KEY]
    out.append((CLUSTER_TOKEN_KEY, token))
    return out


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: Any) -> Any:
        return _CallDetails(
            details.method,
            details.timeout,
            _with_token(details.metadata, self._token),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(
        self,
        method: str,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: bool | None,
        compression: Any,
    ) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


class _AioToken:
    """Adds the cluster token to a call's metadata (the base of the four kinds below)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: aio.ClientCallDetails) -> aio.ClientCallDetails:
        return aio.ClientCallDetails(
            details.method,
            details.timeout,
            aio.Metadata(*_with_token(tuple(details.metadata or ()), self._token)),
            details.credentials,
            details.wait_for_ready,
        )


# One class per call kind: grpc.aio files each interceptor under the first kind it matches
# (an if/elif on isinstance), so one object implementing all four would see unary calls only.
class _AioUnaryUnary(_AioToken, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioToken, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioToken, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioToken, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def cluster_channel(
    address: str,
    secret: ClusterSecret | None,
    options: Sequence[tuple[str, Any]] = (),
    tls: TlsSettings | None = None,
) -> grpc.Channel:
    """A synchronous channel to another kvflow process, sending the cluster token on every
    call (no token when ``secret`` is None), over TLS when ``tls`` (None: this process's
    ``KVFLOW_TLS_*``) has a CA. The caller closes it."""
    plain = channel(address, options, tls)
    if secret is None:
        return plain
    return grpc.intercept_channel(plain, _SyncToken(secret.grpc_token()))


def cluster_aio_channel(
    address: str,
    secret: ClusterSecret | None,
    options: Sequence[tuple[str, Any]] = (),
    tls: TlsSettings | None = None,
) -> aio.Channel:
    """The ``grpc.aio`` twin of :func:`cluster_channel`."""
    kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
    interceptors = [] if secret is None else [kind(secret.grpc_token()) for kind in kinds]
    return aio_channel(address, options, tls, interceptors)
