"""A Generate client that fails over between routers.

Several routers may serve one cluster (`kvflow serve --role router`, `kvflow cluster
--routers N`). ``InferenceClient`` sends a request to one of them; when that router cannot be
reached or dies in the middle of the answer (UNAVAILABLE), it sends the request again to the
next one with ``skip_tokens`` set to the tokens already received, so the caller sees one
uninterrupted answer. This is exact because generation is deterministic: greedy decoding is,
and for sampling the client fixes a seed before the first attempt when the caller gave none.

    with InferenceClient(["127.0.0.1:50051", "127.0.0.1:50052"]) as client:
        for msg in client.generate(request, timeout=60):
            ...
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from kvflow.security.tls import TlsSettings
from kvflow.security.tls import channel as channel_to
from kvflow.stages.api import pb2, pb2_grpc
from kvflow.stages.api.failover import Channels, Retry, bearer, parse_servers, resolve_api_key

__all__ = ["InferenceClient", "parse_servers"]


class InferenceClient:
    """Generate with failover over ``servers`` (router addresses serving the same cluster).

    A request that meets an unreachable or dying router goes to the next one, round after
    round (a short pause before each new round, doubling up to 2 s), for as long as
    ``retry_for_s`` passes without a token coming back — long enough for a supervisor to
    restart the only router. ``max_attempts`` caps the sends of one request (None: no cap).
    Thread-safe for concurrent ``generate`` calls (one gRPC channel per server, shared).
    ``tls``: TLS to the routers (a CA to verify them); None: this process's ``KVFLOW_TLS_*``.
    ``api_key``: sent as Bearer on every call; None: ``KVFLOW_API_KEY`` (failover.py)."""

    def __init__(
        self,
        servers: Sequence[str],
        max_attempts: int | None = None,
        backoff_s: float = 0.25,
        retry_for_s: float = 15.0,
        seed: int | None = None,
        tls: TlsSettings | None = None,
        api_key: str | None = None,
    ) -> None:
        if not servers:
            raise ValueError("InferenceClient needs at least one server address")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if backoff_s < 0 or retry_for_s < 0:
            raise ValueError("backoff_s and retry_for_s must be >= 0")
        self.servers = list(servers)
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.retry_for_s = retry_for_s
        self._rng = random.Random(seed)
        self._channels = Channels(self.servers, lambda server: channel_to(server, (), tls))
        self._metadata = bearer(resolve_api_key(api_key))
        self.failovers = 0  # requests resent to another router, over this client's life

    def generate(self, request: Any, timeout: float = 600.0) -> Iterator[Any]:
        """Yield the GenerateResponse messages of one answer, across router failures."""
        req = pb2.GenerateRequest()
        req.CopyFrom(request)
        if req.sampling.temperature > 0 and not req.sampling.HasField("seed"):
            req.sampling.seed = self._rng.getrandbits(63)  # a resent request samples the same
        retry = Retry(
            self._channels,
            time.monotonic() + timeout,
            self.backoff_s,
            self.retry_for_s,
            self.max_attempts,
        )
        received = 0
        while True:
            try:
                index, server, remaining = retry.next_server("Generate")
            except TimeoutError:
                raise TimeoutError(f"no router answered within {timeout} s") from None
            req.skip_tokens = request.skip_tokens + received
            if retry.attempt and request.request_id:  # a fresh id: the old one may linger
                req.request_id = f"{request.request_id}-r{retry.attempt}"
            stub = pb2_grpc.InferenceStub(self._channels.get(server))
            try:
                for msg in stub.Generate(req, timeout=remaining, metadata=self._metadata):
                    if msg.token_ids:
                        retry.progress()
                    received += len(msg.token_ids)
                    yield msg
            except grpc.RpcError as err:
                retry.failed(index, server, err)
                self.failovers += 1
                continue
            retry.succeeded(index)
            return

    def close(self) -> None:
        self._channels.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
