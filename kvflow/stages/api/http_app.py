"""The HTTP front: the OpenAI-compatible and SGLang-native APIs (FastAPI) over the same
Frontend as the gRPC API, served by uvicorn inside the caller's event loop (the loop that runs
the gRPC server and the pipeline), on the configured host only.

    server = HttpServer(frontend, host, HttpConfig(port=8000))
    await server.start()   # listening; server.port is the bound port
    ...
    await server.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvflow.pipeline import PipelineError
from kvflow.security.tls import TlsSettings, uvicorn_ssl
from kvflow.stages.api.auth import Authenticator, Unauthenticated
from kvflow.stages.api.http_conn import timed_protocol
from kvflow.stages.api.http_errors import HttpError, http_error_for
from kvflow.stages.api.openai_routes import OpenAIApi
from kvflow.stages.api.sglang_routes import SGLangApi

logger = logging.getLogger(__name__)


# Routes a caller may use without a key (load balancers' probes), and those that need admin.
OPEN_PATHS = frozenset({"/health"})
ADMIN_PATHS = frozenset({"/flush_cache"})


def create_app(
    frontend: Any, max_body_bytes: int, max_batch: int = 64, auth: Authenticator | None = None
) -> FastAPI:
    """The FastAPI application of both APIs over ``frontend`` (api/inference.Frontend).
    Every error answers in OpenAI's error JSON (http_errors). With API keys (``auth``), every
    route but OPEN_PATHS needs ``Authorization: Bearer KEY`` (401), ADMIN_PATHS an admin key
    (403); the key decides the caller's tenant (``http_io.caller_tenant``)."""
    app = FastAPI(title="kvflow", docs_url=None, redoc_url=None, openapi_url=None)
    if auth is not None and not auth.open:
        app.add_middleware(_Authenticate, gate=auth)
    app.include_router(OpenAIApi(frontend, max_body_bytes).router())
    app.include_router(SGLangApi(frontend, max_body_bytes, max_batch).router())

    async def known(request: Request, exc: Exception) -> JSONResponse:
        return http_error_for(exc).response()

    async def starlette_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return HttpError(exc.status_code, str(exc.detail)).response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return http_error_for(exc).response()

    app.add_exception_handler(HttpError, known)
    app.add_exception_handler(PipelineError, known)
    app.add_exception_handler(StarletteHTTPException, starlette_error)
    app.add_exception_handler(Exception, unexpected)
    return app


class _Authenticate:
    """ASGI middleware deciding the caller from ``Authorization: Bearer KEY`` (401 without a
    valid key, 403 for ADMIN_PATHS without an admin key) and putting its identity in the
    request's state (``http_io.caller_tenant`` reads it). A plain ASGI callable, not
    Starlette's BaseHTTPMiddleware: that one runs every request in a task group of its own
    and passes every streamed event through a memory stream, a loop iteration per event."""

    def __init__(self, app: ASGIApp, gate: Authenticator) -> None:
        self._app = app
        self._gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS:
            return await self._app(scope, receive, send)
        try:
            identity = self._gate.identify_bearer(Headers(scope=scope).get("authorization"))
        except Unauthenticated as exc:
            return await HttpError(401, str(exc)).response()(scope, receive, send)
        if path in ADMIN_PATHS and not identity.admin:
            error = HttpError(403, f"{path} needs an admin key")
            return await error.response()(scope, receive, send)
        scope.setdefault("state", {})["identity"] = identity
        await self._app(scope, receive, send)


class _LoopServer(uvicorn.Server):
    """uvicorn in someone else's event loop: the process's signal handlers stay the
    caller's (tools/serve.py stops everything on SIGINT/SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """uvicorn serving ``create_app(frontend, ...)`` on ``host:config.port`` (0: a free port)
    as a task of the running loop. ``start`` returns once it listens (OSError if it cannot
    bind); ``stop`` closes it, giving open streams ``grace_s`` to finish."""

    def __init__(
        self,
        frontend: Any,
        host: str,
        config: Any,
        grace_s: float = 2.0,
        auth: Authenticator | None = None,
        tls: TlsSettings | None = None,
    ) -> None:
        self._app = create_app(frontend, config.max_body_bytes, config.max_batch, auth)
        self._ssl = uvicorn_ssl(tls)  # HTTPS when this process serves TLS (tls None: its env)
        self._host = host
        self._port = config.port
        self._grace_s = grace_s
        self._config = config
        self._server: _LoopServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP,
        # and without it every streamed event after the headers waits for a delayed ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        c = self._config
        config = uvicorn.Config(
            self._app,
            http=timed_protocol(c.header_timeout_s, c.body_timeout_s),
            timeout_keep_alive=c.keep_alive_s,  # type: ignore[arg-type]
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(max(1, self._grace_s)),
            **self._ssl,  # type: ignore[arg-type]
        )
        self._server = _LoopServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"HTTP server on {self._host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        self._sock = sock

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        scheme = "https" if self._ssl else "http"
        return f"{scheme}://{host}:{self.port}"

    async def stop(self) -> None:
        """Idempotent."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, self._grace_s + 5.0)
        self._sock.close()
        self._server = self._task = None
