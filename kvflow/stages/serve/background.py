"""BackgroundServer: an EmbeddedCluster and its gRPC server on a private event-loop thread.

For code that is not asyncio itself — tests, benchmarks, notebooks — to run a real server in
the same process and talk to it with ordinary (blocking) gRPC stubs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from kvflow.security.tls import channel as tls_channel
from kvflow.stages.api import pb2, pb2_grpc
from kvflow.stages.api.http_app import HttpServer
from kvflow.stages.api.inference import create_server
from kvflow.stages.serve.config import HttpConfig, ServeConfig
from kvflow.stages.serve.embedded import EmbeddedCluster

T = TypeVar("T")


class BackgroundServer:
    """Starts at construction (listening on 127.0.0.1, a free port); ``close()`` stops it all.

    With ``http`` (an HttpConfig; port 0 picks a free one) the HTTP front runs too, at
    ``http.url``. ``stub`` is a blocking InferenceStub on ``address``; ``call(fn)`` runs the
    coroutine ``fn()`` on the server's loop and returns its result.
    """

    def __init__(
        self,
        config: ServeConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        http: HttpConfig | None = None,
        auth: Any = None,
    ) -> None:
        self.config = config
        self._auth = auth  # an api.auth.Authenticator; None: open
        self._http_config = http
        self.http: HttpServer | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        try:
            self.cluster: EmbeddedCluster = self.call(lambda: self._start(host, port))
        except BaseException:
            self._stop_loop()
            raise
        self.address = f"{host}:{self.port}"
        self.channel = tls_channel(self.address)  # TLS when this process connects with it
        self.stub = pb2_grpc.InferenceStub(self.channel)

    async def _start(self, host: str, port: int) -> EmbeddedCluster:
        cluster = EmbeddedCluster(self.config)
        try:
            await cluster.start()
            self.server, self.port = create_server(cluster, host, port, self._auth)
            await self.server.start()
            if self._http_config is not None:
                self.http = HttpServer(cluster, host, self._http_config, auth=self._auth)
                await self.http.start()
        except BaseException:
            await cluster.stop()
            raise
        return cluster

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float = 3600.0) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(fn(), self.loop)
        return fut.result(timeout)

    def generate(
        self, prompt: str | list[int], *, timeout: float = 3600.0, **fields: Any
    ) -> list[Any]:
        """Every GenerateResponse of one Generate call (fields as in GenerateRequest)."""
        req = pb2.GenerateRequest(**fields)
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return list(self.stub.Generate(req, timeout=timeout))

    def close(self) -> None:
        """Stop the server and the cluster (shards flushed, engines stopped). Idempotent."""
        if not self._thread.is_alive():
            return
        self.channel.close()

        async def stop() -> None:
            if self.http is not None:
                await self.http.stop()
            await self.server.stop(0.5)
            await self.cluster.stop()

        try:
            self.call(stop, timeout=60.0)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()
