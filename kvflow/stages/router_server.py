"""RouterServer: the conductor and the gRPC inference frontend of a multi-process cluster
(`kvflow serve --role router`). Several may run at once: each reads the nodes and who holds
which block from the metadata group.

Its pipeline: tokenize, hash, route (the conductor, with every prefill node's prefix read from
the metadata), then prefill and decode as calls to the chosen nodes. A node that fails a call
is marked unhealthy and the request is routed again (its prefix is recomputed or pulled
elsewhere); tokens already sent to the client are not sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvflow.kvdb import KVLayout, StaticAdminSource
from kvflow.pipeline import Metrics, Pipeline, PipelineConfig, RequestContext, Stage, Tracer
from kvflow.replication import RemoteMetadata
from kvflow.router import (
    Conductor,
    InstanceState,
    MetadataPrefixIndex,
    Profile,
    ProfileMismatchError,
    Rejection,
    RouterConfig,
    RouteRequest,
    TransferEstimator,
    UnknownInstanceError,
    load_profile,
)
from kvflow.stages.api import node_pb2, node_pb2_grpc
from kvflow.stages.engine import Tokenizer
from kvflow.stages.errors import NoCapacity, Rejected
from kvflow.stages.hash import HashStage
from kvflow.stages.remote_peers import parse_node_address
from kvflow.stages.route import RouteStage, route_or_wait
from kvflow.stages.serving_metrics import ServingMetrics
from kvflow.stages.state import GenerateState
from kvflow.stages.tokenize import TokenizeStage

logger = logging.getLogger(__name__)

REFRESH_S = 1.0
ATTEMPTS = 5  # a request may meet several dead nodes before they are all marked
TCP_BYTES_PER_S = 1.5e9


@dataclass(frozen=True)
class RouterSettings:
    """The router process. ``meta``: the metadata replicas' gRPC addresses."""

    model_dir: Path
    meta: tuple[str, ...]
    policy: str = "cache-aware"
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    balancing_threshold: float = 2.0
    default_max_tokens: int = 64
    max_tokens_limit: int = 4096
    node_dead_after_s: float = 5.0
    # A request that finds no healthy prefill or decode node (the only one is restarting)
    # waits this long for one before it is rejected.
    instance_wait_s: float = 30.0
    trace_capacity: int = 1024
    seed: int = 0


@dataclass
class RemoteNode:
    """A node as the router sees it."""

    instance_id: str
    kind: str
    control: str
    state: InstanceState
    channel: grpc.aio.Channel
    stub: Any = field(init=False)
    # Routable only once it answered a probe (it registers before it listens), and again
    # after a failed call only when it answers one more (a restarted process does).
    ready: bool = False
    was_ready: bool = False

    def __post_init__(self) -> None:
        self.stub = node_pb2_grpc.NodeStub(self.channel)

    async def reconnect(self, control: str | None = None) -> None:
        """A fresh channel (to ``control`` if it moved): the old one may be in backoff."""
        await self.channel.close()
        self.control = control or self.control
        self.channel = grpc.aio.insecure_channel(self.control)
        self.stub = node_pb2_grpc.NodeStub(self.channel)


def _sampling_msg(state: GenerateState) -> Any:
    s = state.sampling
    msg = node_pb2.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    msg.ignore_eos = s.ignore_eos
    if s.seed is not None:
        msg.seed = s.seed
    return msg


class RouterServer:
    """Build with ``RouterServer(settings)``; ``await start()``; ``await stop()``. Duck-types
    the parts of EmbeddedCluster that the inference service reads."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.model_dir = settings.model_dir
        self.tokenizer = Tokenizer.from_dir(settings.model_dir)
        self.metadata = RemoteMetadata(list(settings.meta))
        self.metadata.start()
        self.prefill: dict[str, RemoteNode] = {}
        self.decode: dict[str, RemoteNode] = {}
        self.tracer = Tracer(settings.trace_capacity)
        self.metrics = Metrics()
        self.serving_metrics = ServingMetrics(self.metrics)
        self._node_failures = self.metrics.counter(
            "node_failures", "Calls to a node that failed (the request was routed again)", ["node"]
        )
        self._instance_waits = self.metrics.counter(
            "instance_waits", "Requests that found no healthy prefill or decode node and waited"
        )
        self.failures_total = 0
        self.waits_total = 0
        self.config = settings  # default_max_tokens / max_tokens_limit for the service

    async def start(self, timeout_s: float = 60.0) -> None:
        """Wait for the metadata and at least one prefill and one decode node."""
        await asyncio.to_thread(self.metadata.wait_ready, timeout_s)
        deadline = time.monotonic() + timeout_s
        while not (self.prefill and self.decode):
            await self._refresh()
            if time.monotonic() > deadline:
                raise TimeoutError("no prefill and decode nodes registered in the metadata")
            if not (self.prefill and self.decode):
                await asyncio.sleep(0.2)
        info = await self._first_info(deadline)
        self.model_fingerprint = info.model_fingerprint
        self.max_model_len = info.max_model_len
        self.block_size = info.block_size
        self.layout = KVLayout(
            info.num_layers, info.num_kv_heads, info.head_dim, info.block_size, info.dtype
        )
        self.conductor = self._conductor(info)
        self.pipeline = Pipeline(
            [
                TokenizeStage(self.tokenizer, info.vocab_size, info.max_model_len),
                HashStage(info.model_fingerprint, self.layout),
                RouteStage(
                    self.conductor,
                    self.prefill,  # type: ignore[arg-type]
                    self.decode,  # type: ignore[arg-type]
                    instance_wait_s=self.settings.instance_wait_s,
                    on_wait=self.count_wait,
                ),
                RemoteGenerateStage(self),
            ],
            PipelineConfig(
                queue_size=256, default_concurrency=256, trace_capacity=self.settings.trace_capacity
            ),
            tracer=self.tracer,
            metrics=self.metrics,
        )
        await self.pipeline.start()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def _first_info(self, deadline: float) -> Any:
        """Info of the first prefill node that answers (a node registers before it listens)."""
        while True:
            for node in list(self.prefill.values()):
                try:
                    return await node.stub.Info(node_pb2.InfoRequest(), timeout=2)
                except grpc.aio.AioRpcError:
                    continue
            if time.monotonic() > deadline:
                raise TimeoutError("no prefill node answered Info")
            await asyncio.sleep(0.2)
            await self._refresh()

    def _conductor(self, info: Any) -> Conductor:
        s = self.settings
        try:
            profile = load_profile(self.model_dir, model_id=info.model_fingerprint)
        except ProfileMismatchError:
            profile = Profile.default()
        return Conductor(
            RouterConfig(
                policy=s.policy,
                ttft_slo_s=s.ttft_slo_s,
                tbt_slo_s=s.tbt_slo_s,
                balancing_threshold=s.balancing_threshold,
                block_size=info.block_size,
                block_nbytes=info.page_nbytes,
                seed=s.seed,
            ),
            MetadataPrefixIndex(self.metadata.view()),
            profile.prefill,
            profile.decode,
            TransferEstimator(TCP_BYTES_PER_S),
        )

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self._refresh()
            except Exception:
                logger.warning("router: node refresh failed", exc_info=True)

    async def _refresh(self) -> None:
        """Add nodes that registered; mark nodes without a recent heartbeat unhealthy."""
        nodes = await asyncio.to_thread(lambda: self.metadata.view().nodes())
        now = time.time()
        if any(now - n.last_heartbeat > self.settings.node_dead_after_s for n in nodes):
            # Drop the dead nodes' replicas from the metadata (the group applies its own
            # node_dead_after_s); readers then stop asking them.
            reaped = await asyncio.to_thread(self.metadata.reap_dead_nodes)
            if reaped:
                logger.warning("router: dropped dead nodes %s and their replicas", reaped)
        polls: list[tuple[RemoteNode, bool]] = []
        for info in nodes:
            addresses = parse_node_address(info.address)
            group = {"prefill": self.prefill, "decode": self.decode}.get(info.kind)
            if addresses is None or group is None:
                continue
            node = group.get(info.node)
            if node is None:
                node = RemoteNode(
                    info.node,
                    info.kind,
                    addresses[0],
                    InstanceState(info.node, info.kind),
                    grpc.aio.insecure_channel(addresses[0]),
                )
                group[info.node] = node
            elif node.control != addresses[0]:  # it came back elsewhere: keep its books
                node.ready = False
                await node.reconnect(addresses[0])
            polls.append((node, now - info.last_heartbeat < self.settings.node_dead_after_s))
        await asyncio.gather(*(self._poll(node, alive) for node, alive in polls))

    @staticmethod
    async def _poll(node: RemoteNode, alive: bool) -> None:
        """One ``Info`` call per live node per refresh. It is the readiness probe (a node is
        routable once it answers, and again after a failed call only once it answers again; a
        node that does not answer gets a fresh channel) and the node's own account of its
        load, every router's requests: what other routers sent there is added to this
        router's books (``set_reported_load``)."""
        if alive:
            try:
                info = await node.stub.Info(node_pb2.InfoRequest(), timeout=1.0)
            except grpc.aio.AioRpcError:
                if not node.ready:
                    await node.reconnect()
            else:
                if not node.ready and node.was_ready:
                    logger.info("router: node=%s answers again; routing to it", node.instance_id)
                node.ready = node.was_ready = True
                try:
                    node.state.set_reported_load(
                        info.queued_prefill_s,
                        info.decode_batch_size,
                        info.decode_context_tokens,
                        now=time.monotonic(),
                    )
                except ValueError as exc:  # keep the last report
                    logger.warning(
                        "router: bad load report from node=%s: %s", node.instance_id, exc
                    )
        node.state.set_healthy(alive and node.ready)

    def count_wait(self) -> None:
        self.waits_total += 1
        self._instance_waits.inc()

    def mark_failed(self, node: RemoteNode) -> None:
        """Route around ``node`` until it answers a probe again (a dead node never does)."""
        node.state.set_healthy(False)
        node.ready = False
        self.failures_total += 1
        self._node_failures.labels(node=node.instance_id).inc()
        logger.warning("router: node=%s failed a call; routing around it", node.instance_id)

    async def stop(self) -> None:
        task = getattr(self, "_refresher", None)
        if task is not None:
            task.cancel()
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:
            await pipeline.stop(drain=False, timeout_s=5.0)
        for node in [*self.prefill.values(), *self.decode.values()]:
            await node.channel.close()
        self.metadata.close()

    # -- what the inference service reads -------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per node: health, this router's queue, and the load it routes on (its own books
        plus what the node reports other routers sent: ``external_*``)."""
        now = time.monotonic()
        instances = []
        for n in [*self.prefill.values(), *self.decode.values()]:
            snap = n.state.snapshot(now)
            ext_s, ext_batch, _ = n.state.external_load
            values = {
                "healthy": float(snap.healthy),
                "queued_requests": float(snap.queued_requests),
                "queued_seconds": snap.queued_seconds,
                "decode_batch_size": float(snap.decode_batch_size),
                "external_queued_seconds": ext_s,
                "external_decode_batch_size": float(ext_batch),
            }
            instances.append((n.instance_id, n.kind, values))
        router = {
            "in_flight": float(self.pipeline.in_flight()),
            "node_failures": float(self.failures_total),
            "instance_waits": float(self.waits_total),
        }
        return {"router": router, "instances": instances}

    def admin_source(self) -> StaticAdminSource:
        return StaticAdminSource({}, self.metadata.view())


class RemoteGenerateStage(Stage):
    """prefill and decode on the chosen nodes; on a node failure, route again and retry."""

    name = "generate"

    def __init__(self, router: RouterServer) -> None:
        self._router = router

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        for attempt in range(ATTEMPTS):
            if attempt:
                await self._reroute(ctx, state)
            try:
                await self._once(ctx, state)
                return
            except grpc.aio.AioRpcError as err:
                if err.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.INTERNAL,
                ):
                    raise
                failed = getattr(err, "kvflow_node", None)
                if failed is not None:
                    self._router.mark_failed(failed)
                logger.warning(
                    "req=%s attempt %d failed: %s", ctx.request_id, attempt + 1, err.details()
                )
                if attempt + 1 == ATTEMPTS:
                    raise

    async def _reroute(self, ctx: RequestContext[Any], state: GenerateState) -> None:
        r = self._router
        for node in (state.prefill, state.decode):
            if node is not None:
                for fn in (node.state.finish, node.state.remove_decode):
                    with contextlib.suppress(UnknownInstanceError, KeyError):
                        fn(ctx.request_id)
        req = RouteRequest(ctx.request_id, tuple(state.block_keys), state.prompt_len)
        result = await route_or_wait(
            r.conductor,
            req,
            lambda: ([p.state for p in r.prefill.values()], [d.state for d in r.decode.values()]),
            r.settings.instance_wait_s,
            on_wait=r.count_wait,
        )
        if isinstance(result, Rejection):
            raise Rejected(result)
        state.decision = result
        state.prefill = r.prefill[result.prefill_id]  # type: ignore[assignment]
        state.decode = r.decode[result.decode_id]  # type: ignore[assignment]
        r.conductor.commit(result, state.prefill.state, state.decode.state)

    async def _once(self, ctx: RequestContext[Any], state: GenerateState) -> None:
        prefill: RemoteNode = state.prefill  # type: ignore[assignment]
        decode: RemoteNode = state.decode  # type: ignore[assignment]
        pages = -(-state.prompt_len // self._router.block_size)
        with ctx.span("reserve", node=decode.instance_id):
            lease = await self._call(
                decode,
                decode.stub.Reserve(
                    node_pb2.ReserveRequest(request_id=ctx.request_id, num_pages=pages), timeout=10
                ),
            )
        produced: list[int] = []
        try:
            with ctx.span("prefill", node=prefill.instance_id) as span:
                req = node_pb2.PrefillRequest(
                    request_id=ctx.request_id,
                    token_ids=state.prompt_ids,
                    tenant=state.tenant,
                    sampling=_sampling_msg(state),
                    target_transfer_address=lease.transfer_address,
                    target_segment=lease.segment,
                    target_offsets=lease.offsets,
                    predicted_prefill_s=state.decision.t_prefill if state.decision else 0.0,
                )
                done = None
                async for ev in self._stream(prefill, prefill.stub.Prefill(req, timeout=600)):
                    if ev.has_first_token:
                        produced.append(ev.first_token)
                        if state.first_token_at is None:
                            state.first_token_at = time.monotonic()
                        state.token_times = [state.first_token_at]
                        self._emit(ctx, state, produced)
                    if ev.done:
                        done = ev
                if done is None:
                    raise NoCapacity(f"node {prefill.instance_id} ended the prefill early")
                state.num_cached_tokens = done.cached_tokens
                state.cached_by_tier = dict(done.cached_by_tier)
                state.pulled_tokens = done.pulled_tokens
                state.first_token = produced[0]
                span.set_attrs(cached_tokens=done.cached_tokens)
            with contextlib.suppress(UnknownInstanceError):
                prefill.state.finish(ctx.request_id)  # its prefill queue booking is over
            if done.finish_reason == "stop" or state.max_tokens == 1:
                await decode.stub.Release(node_pb2.ReleaseRequest(lease_id=lease.lease_id))
                state.output_ids, state.finish_reason = produced, done.finish_reason or "length"
                state.token_times = [state.first_token_at or time.monotonic()]
                return
            with ctx.span("decode", node=decode.instance_id):
                req = node_pb2.DecodeRequest(
                    request_id=ctx.request_id,
                    lease_id=lease.lease_id,
                    token_ids=[*state.prompt_ids, produced[0]],
                    num_prefix_tokens=state.prompt_len,
                    max_tokens=state.max_tokens,
                    sampling=_sampling_msg(state),
                    tenant=state.tenant,
                )
                async for ev in self._stream(decode, decode.stub.Decode(req, timeout=600)):
                    if ev.token_ids:
                        produced.extend(ev.token_ids)
                        state.token_times.extend(time.monotonic() for _ in ev.token_ids)
                        self._emit(ctx, state, produced)
                    if ev.finished:
                        state.finish_reason = ev.finish_reason
            state.output_ids = produced
            state.finished_at = time.monotonic()
        except BaseException:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await decode.stub.Release(
                    node_pb2.ReleaseRequest(lease_id=lease.lease_id), timeout=5
                )
            raise

    @staticmethod
    def _emit(ctx: RequestContext[Any], state: GenerateState, produced: list[int]) -> None:
        """Emit the tokens past what the client already has: a retry regenerates the same
        tokens (the node's sampling is seeded per request id) and only the new ones go out."""
        if len(produced) > state.emitted_tokens:
            ctx.emit(("tokens", produced[state.emitted_tokens :]))
            state.emitted_tokens = len(produced)

    @staticmethod
    async def _call(node: RemoteNode, call: Any) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            err.kvflow_node = node  # type: ignore[attr-defined]
            raise

    @staticmethod
    async def _stream(node: RemoteNode, call: Any) -> Any:
        try:
            async for ev in call:
                yield ev
        except grpc.aio.AioRpcError as err:
            err.kvflow_node = node  # type: ignore[attr-defined]
            raise

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        return None
