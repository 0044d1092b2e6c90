"""The gRPC inference API (Generate, Tokenize, Health, Stats, ExportTrace), typed against the
``Frontend`` protocol that the embedded server and a cluster router both implement."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from grpc_reflection.v1alpha import reflection

from kvflow.kvdb import ADMIN_SERVICE_NAME, AccessDeniedError, Viewer, add_admin_service
from kvflow.pipeline import QueueFull
from kvflow.security import process_secret
from kvflow.security.grpc_input import AioInputInterceptor
from kvflow.security.tls import add_port
from kvflow.stages.api import SERVICE_NAME, pb2, pb2_grpc
from kvflow.stages.api.auth import (
    Authenticator,
    AuthInterceptor,
    PermissionDenied,
    Unauthenticated,
    owner_tenant,
    tenant_for,
    viewer_for,
)
from kvflow.stages.api.choices import start_generation
from kvflow.stages.api.convert import logprobs_to_msgs, sampling_fields, status_for
from kvflow.stages.api.generation import GenerateInput, Usage, request_id_of
from kvflow.stages.api.limits import TokenizerPool, check_prompt_bytes, max_message_bytes
from kvflow.stages.errors import InvalidArgument, NoCapacity, RateLimited

logger = logging.getLogger(__name__)


class Frontend(Protocol):
    """What the inference APIs (gRPC here, HTTP in http_app) serve: a pipeline of the seven
    stages (or the router's part of it), the tokenizer, the model's identity (``model_name``:
    the served name; ``card``: its ModelCard), and introspection. ``config`` has
    ``default_max_tokens``, ``max_tokens_limit`` and ``max_prompt_bytes``; ``prefill``/``decode``
    map instance ids; ``tenant_limits`` (api/limits.py) admits each tenant's requests;
    ``admission`` (pipeline/admission.py) is the waiting queue every request passes."""

    config: Any
    pipeline: Any
    admission: Any
    tokenizer: Any
    grammars: Any  # a GrammarCompiler: requests' grammars are compiled (checked) before queueing
    serving_metrics: Any
    tenant_limits: Any
    conductor: Any
    model_dir: Any
    model_name: str
    card: Any
    model_fingerprint: str
    block_size: int
    max_model_len: int
    prefill: Any
    decode: Any

    def stats(self) -> dict[str, Any]: ...

    async def export_trace(self, last: int | None, tenant: str | None = None) -> dict[str, Any]:
        """The last requests' Chrome trace; only ``tenant``'s requests when given."""
        ...

    def admin_source(self) -> Any: ...

    async def flush_cache(self) -> int:
        """Drop every cached block no running request holds; the number dropped.
        Raises InvalidArgument while requests run (SGLang's rule)."""
        ...


class InferenceServicer(pb2_grpc.InferenceServicer):  # type: ignore[misc,name-defined]
    def __init__(self, cluster: Frontend, auth: Authenticator | None = None) -> None:
        self._cluster = cluster
        self._auth = auth or Authenticator(None)
        self._tokenizer = TokenizerPool(cluster.tokenizer)
        self._in_flight: set[str] = set()  # request ids of the Generate calls running now

    @staticmethod
    def _input(request: Any, tenant: str, request_id: str) -> GenerateInput:
        which = request.WhichOneof("input")
        return GenerateInput(
            prompt_text=request.prompt if which == "prompt" else None,
            prompt_ids=list(request.token_ids.ids) if which == "token_ids" else None,
            tenant=tenant,
            max_tokens=request.max_tokens or None,
            sampling=sampling_fields(request.sampling),
            stop=tuple(request.stop),
            logprob_start=request.logprob_start,
            request_id=request_id,
            skip_tokens=request.skip_tokens,
        )

    # -- RPCs -------------------------------------------------------------------------------
    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            identity = self._auth.identify_metadata(context.invocation_metadata())
            tenant = tenant_for(identity, request.tenant)  # the key's, never the request's
            rid = request_id_of(request.request_id)
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
            async for response in self._generate(request, context, tenant, rid):
                yield response
        finally:
            self._in_flight.discard(rid)

    async def _generate(
        self, request: Any, context: grpc.aio.ServicerContext, tenant: str, rid: str
    ) -> AsyncIterator[Any]:
        try:
            if request.WhichOneof("input") is None:
                raise InvalidArgument("give a prompt or token_ids")
            gen = await start_generation(self._cluster, self._input(request, tenant, rid))
        except (InvalidArgument, RateLimited) as exc:
            code, details = status_for(exc)
            await context.abort(code, details)
            return
        try:
            async for chunk in gen.chunks():
                yield pb2.GenerateResponse(
                    token_ids=chunk.token_ids,
                    text=chunk.text,
                    logprobs=logprobs_to_msgs(pb2.TokenLogprob, chunk.logprobs),
                )
        except BaseException as exc:
            if _is_cancel(exc):
                raise
            code, details = status_for(exc)
            logger.info("req=%s ended: %s %s", gen.request_id, code.name, details)
            if isinstance(exc, QueueFull):  # as HTTP's Retry-After, in whole seconds
                retry = (("retry-after", str(int(exc.retry_after_s))),)
                await context.abort(code, details, trailing_metadata=retry)
            await context.abort(code, details)
            return
        start, prompt_lps = gen.prompt_logprobs
        yield pb2.GenerateResponse(
            finished=True,
            finish_reason=gen.finish_reason or "",
            usage=_usage_msg(gen.usage()),
            prompt_logprobs=logprobs_to_msgs(pb2.TokenLogprob, prompt_lps),
            prompt_logprobs_start=start,
        )

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            check_prompt_bytes(request.text, self._cluster.config.max_prompt_bytes)
            ids = await self._tokenizer.encode(request.text)
        except (InvalidArgument, NoCapacity) as exc:
            await context.abort(*status_for(exc))
        return pb2.TokenizeResponse(token_ids=ids)

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        c = self._cluster
        return pb2.HealthResponse(
            serving=c.pipeline.running,
            model=c.model_name,
            model_fingerprint=c.model_fingerprint,
            block_size=c.block_size,
            max_model_len=c.max_model_len,
            prefill_instances=list(c.prefill),
            decode_instances=list(c.decode),
            policy=c.conductor.policy_name,
        )

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """An admin: the router's and every instance's counters. A user: only its tenant's
        requests in flight (the instances' queues and batches are every tenant's)."""
        identity = self._auth.identify_metadata(context.invocation_metadata())
        if not identity.admin:
            tenant = owner_tenant(identity)
            in_flight = float(self._cluster.tenant_limits.in_flight(tenant))
            return pb2.StatsResponse(router={"tenant_in_flight": in_flight})
        stats = self._cluster.stats()
        return pb2.StatsResponse(
            router=stats["router"],
            instances=[
                pb2.InstanceStats(instance_id=i, kind=k, values=v) for i, k, v in stats["instances"]
            ],
        )

    async def ExportTrace(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """An admin: every request's trace; a user: only its tenant's requests."""
        identity = self._auth.identify_metadata(context.invocation_metadata())
        tenant = None if identity.admin else owner_tenant(identity)
        doc = await self._cluster.export_trace(request.last_n or None, tenant)
        return pb2.ExportTraceResponse(chrome_trace_json=json.dumps(doc).encode())


def _usage_msg(u: Usage) -> Any:
    return pb2.Usage(
        request_id=u.request_id,
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens,
        cached_by_tier=[
            pb2.TierTokens(tier=t, tokens=n) for t, n in sorted(u.cached_by_tier.items())
        ],
        ttft_ms=u.ttft_s * 1000.0,
        mean_tbt_ms=u.mean_tbt_s * 1000.0,
        prefill_instance=u.prefill_instance,
        decode_instance=u.decode_instance,
        predicted_ttft_ms=u.predicted_ttft_s * 1000.0,
        pulled_tokens=u.pulled_tokens,
        e2e_ms=u.e2e_s * 1000.0,
    )


def _viewer_of(auth: Authenticator) -> Callable[[Any], Viewer]:
    """The kvdb admin service's view of a call: from its API key (the interceptor has
    already refused unknown keys; one that slips through is refused here too)."""

    def viewer(metadata: Any) -> Viewer:
        try:
            return viewer_for(auth.identify_metadata(metadata))
        except Unauthenticated as exc:
            raise AccessDeniedError(str(exc)) from None

    return viewer


def _is_cancel(exc: BaseException) -> bool:
    import asyncio

    return isinstance(exc, asyncio.CancelledError | GeneratorExit)


def create_server(
    cluster: Frontend, host: str, port: int, auth: Authenticator | None = None
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with the inference service, the kvdb admin service (``kvflow kvdb``)
    and reflection, behind the API-key gate (``auth``; None: open, or the cluster secret of
    this process); returns (server, port). Call ``await server.start()``. The largest
    message it receives is derived from the prompt limit (``limits.max_message_bytes``)."""
    auth = auth or Authenticator(None, process_secret())
    auth.log_mode()
    c = cluster.config
    limit = max_message_bytes(
        c.max_prompt_bytes, cluster.max_model_len, getattr(c, "max_upload_bytes", 0)
    )
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)],
        interceptors=[AuthInterceptor(auth), AioInputInterceptor()],
    )
    pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(cluster, auth), server)
    add_admin_service(server, cluster.admin_source(), viewer_of=_viewer_of(auth))
    reflection.enable_server_reflection(
        (SERVICE_NAME, ADMIN_SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = add_port(server, f"{host}:{port}", None)  # TLS when this process serves it
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server, bound
