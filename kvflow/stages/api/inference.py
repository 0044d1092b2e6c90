"""The gRPC inference API (Generate, Tokenize, Health, Stats, ExportTrace), typed against the
``Frontend`` protocol that the embedded server and a cluster router both implement."""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
from grpc_reflection.v1alpha import reflection

from kvflow.kvdb import ADMIN_SERVICE_NAME, add_admin_service
from kvflow.pipeline import (
    Overloaded,
    PipelineClosed,
    RequestContext,
)
from kvflow.security import process_secret
from kvflow.security.grpc_input import AioInputInterceptor
from kvflow.stages.api import SERVICE_NAME, pb2, pb2_grpc
from kvflow.stages.api.auth import (
    OPEN,
    Authenticator,
    AuthInterceptor,
    Identity,
    PermissionDenied,
    Unauthenticated,
    tenant_for,
)
from kvflow.stages.api.convert import sampling_from, status_for
from kvflow.stages.api.limits import TokenizerPool, check_prompt_bytes
from kvflow.stages.detokenize import IncrementalDetokenizer
from kvflow.stages.engine import SamplingParams
from kvflow.stages.errors import InvalidArgument, NoCapacity
from kvflow.stages.state import GenerateState

logger = logging.getLogger(__name__)

_MAX_REQUEST_ID = 128


class Frontend(Protocol):
    """What the inference API serves: a pipeline of the seven stages (or the router's part of
    it), the tokenizer, the model's identity, and introspection. ``config`` has
    ``default_max_tokens`` and ``max_tokens_limit``; ``prefill``/``decode`` map instance ids."""

    config: Any
    pipeline: Any
    tokenizer: Any
    serving_metrics: Any
    conductor: Any
    model_dir: Any
    model_fingerprint: str
    block_size: int
    max_model_len: int
    prefill: Any
    decode: Any

    def stats(self) -> dict[str, Any]: ...

    async def export_trace(self, last: int | None) -> dict[str, Any]: ...

    def admin_source(self) -> Any: ...


class InferenceServicer(pb2_grpc.InferenceServicer):  # type: ignore[misc,name-defined]
    def __init__(self, cluster: Frontend, auth: Authenticator | None = None) -> None:
        self._cluster = cluster
        self._auth = auth or Authenticator(None)
        self._config = cluster.config
        self._tokenizer = TokenizerPool(cluster.tokenizer)
        self._in_flight: set[str] = set()  # request ids of the Generate calls running now

    # -- request parsing --------------------------------------------------------------------
    def _sampling(self, request: Any) -> tuple[int, SamplingParams]:
        c = self._config
        max_tokens = request.max_tokens or c.default_max_tokens
        if max_tokens > c.max_tokens_limit:
            raise InvalidArgument(
                f"max_tokens {max_tokens} is out of range [1, {c.max_tokens_limit}]"
            )
        return max_tokens, sampling_from(request.sampling, max_tokens)

    def _state(self, request: Any, identity: Identity = OPEN) -> GenerateState:
        max_tokens, sampling = self._sampling(request)
        which = request.WhichOneof("input")
        if which is None:
            raise InvalidArgument("give a prompt or token_ids")
        state = GenerateState(
            tenant=tenant_for(identity, request.tenant),  # the key's, never the request's
            max_tokens=max_tokens,
            sampling=sampling,
            submitted_at=time.monotonic(),
        )
        if which == "prompt":
            check_prompt_bytes(request.prompt)
            state.prompt_text = request.prompt
        else:
            state.prompt_ids = list(request.token_ids.ids)
        if request.skip_tokens > max_tokens:
            raise InvalidArgument(
                f"skip_tokens {request.skip_tokens} is more than max_tokens {max_tokens}"
            )
        return state

    def _request_id(self, request: Any) -> str:
        rid = request.request_id or uuid.uuid4().hex[:16]
        if len(rid) > _MAX_REQUEST_ID or not rid.isprintable() or "/" in rid:
            raise InvalidArgument(
                f"request_id must be at most {_MAX_REQUEST_ID} printable characters without '/'"
            )
        return rid

    # -- RPCs -------------------------------------------------------------------------------
    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            identity = self._auth.identify_metadata(context.invocation_metadata())
            state = self._state(request, identity)
            rid = self._request_id(request)
        except InvalidArgument as exc:
            await context.abort(*status_for(exc))
            return
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            return
        except PermissionDenied as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            return
        if rid in self._in_flight:  # used to fail as INTERNAL, deep in the pipeline
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight"
            )
            return
        self._in_flight.add(rid)
        try:
            async for response in self._generate(request, context, rid, state):
                yield response
        finally:
            self._in_flight.discard(rid)

    async def _generate(
        self, request: Any, context: grpc.aio.ServicerContext, rid: str, state: GenerateState
    ) -> AsyncIterator[Any]:
        try:
            ctx = RequestContext(rid, state=state)
            handle = self._cluster.pipeline.try_submit(ctx)
        except (InvalidArgument, Overloaded, PipelineClosed) as exc:
            code, details = status_for(exc)
            await context.abort(code, details)
            return
        detok = IncrementalDetokenizer(self._cluster.tokenizer)
        metrics = self._cluster.serving_metrics
        skip = request.skip_tokens  # tokens the caller already has (a resumed request)
        try:
            async for kind, payload in handle:
                if kind != "tokens":
                    continue
                if skip:  # the detokenizer still sees them: the text goes on from there
                    detok.add(payload[:skip])
                    payload, skip = payload[skip:], max(0, skip - len(payload))
                    if not payload:
                        continue
                yield pb2.GenerateResponse(token_ids=payload, text=detok.add(payload))
            await handle.result()
        except BaseException as exc:
            handle.cancel("client went away" if _is_cancel(exc) else "server error")
            if _is_cancel(exc):
                metrics.requests.labels(outcome="cancelled").inc()
                raise
            code, details = status_for(exc)
            metrics.requests.labels(outcome=code.name.lower()).inc()
            logger.info("req=%s ended: %s %s", ctx.request_id, code.name, details)
            await context.abort(code, details)
            return
        usage = self._usage(ctx.request_id, state)
        metrics.requests.labels(outcome="ok").inc()
        yield pb2.GenerateResponse(
            text=detok.flush(), finished=True, finish_reason=state.finish_reason or "", usage=usage
        )

    def _usage(self, request_id: str, state: GenerateState) -> Any:
        m = self._cluster.serving_metrics
        ttft = (state.first_token_at or state.submitted_at) - state.submitted_at
        times = state.token_times
        gaps = [b - a for a, b in itertools.pairwise(times)]
        m.ttft.observe(ttft)
        for gap in gaps:
            m.tbt.observe(gap)
        m.prompt_tokens.inc(state.prompt_len)
        m.generated_tokens.inc(len(state.output_ids))
        for tier, tokens in state.cached_by_tier.items():
            m.cached_tokens.labels(tier=tier).inc(tokens)
        decision = state.decision
        return pb2.Usage(
            request_id=request_id,
            prompt_tokens=state.prompt_len,
            completion_tokens=len(state.output_ids),
            cached_tokens=state.num_cached_tokens,
            cached_by_tier=[
                pb2.TierTokens(tier=t, tokens=n) for t, n in sorted(state.cached_by_tier.items())
            ],
            ttft_ms=ttft * 1000.0,
            mean_tbt_ms=(sum(gaps) / len(gaps) * 1000.0) if gaps else 0.0,
            prefill_instance=decision.prefill_id if decision else "",
            decode_instance=decision.decode_id if decision else "",
            predicted_ttft_ms=decision.ttft_s * 1000.0 if decision else 0.0,
            pulled_tokens=state.pulled_tokens,
            e2e_ms=((state.finished_at or time.monotonic()) - state.submitted_at) * 1000.0,
        )

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            check_prompt_bytes(request.text)  # Tokenize had no limit at all
            ids = await self._tokenizer.encode(request.text)
        except (InvalidArgument, NoCapacity) as exc:
            await context.abort(*status_for(exc))
        return pb2.TokenizeResponse(token_ids=ids)

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        c = self._cluster
        return pb2.HealthResponse(
            serving=c.pipeline.running,
            model=str(c.model_dir),
            model_fingerprint=c.model_fingerprint,
            block_size=c.block_size,
            max_model_len=c.max_model_len,
            prefill_instances=list(c.prefill),
            decode_instances=list(c.decode),
            policy=c.conductor.policy_name,
        )

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        stats = self._cluster.stats()
        return pb2.StatsResponse(
            router=stats["router"],
            instances=[
                pb2.InstanceStats(instance_id=i, kind=k, values=v) for i, k, v in stats["instances"]
            ],
        )

    async def ExportTrace(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        doc = await self._cluster.export_trace(request.last_n or None)
        return pb2.ExportTraceResponse(chrome_trace_json=json.dumps(doc).encode())


def _is_cancel(exc: BaseException) -> bool:
    import asyncio

    return isinstance(exc, asyncio.CancelledError | GeneratorExit)


def create_server(
    cluster: Frontend, host: str, port: int, auth: Authenticator | None = None
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with the inference service, the kvdb admin service (``kvflow kvdb``)
    and reflection; returns (server, port).
    Call ``await server.start()``."""
    auth = auth or Authenticator(None, process_secret())
    auth.log_mode()
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)],
        interceptors=[AuthInterceptor(auth), AioInputInterceptor()],
    )
    pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(cluster, auth), server)
    add_admin_service(server, cluster.admin_source())
    reflection.enable_server_reflection(
        (SERVICE_NAME, ADMIN_SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server, bound
