"""RouterServer: the conductor and the inference frontend of a multi-process cluster
(`kvflow serve --role router`). Several may run at once: each reads the nodes and who holds
which block from the metadata group, and books only the requests it routes (nodes report the
rest of their load in ``Info``).

Its pipeline: tokenize, hash, route (the conductor, with every prefill node's prefix read from
the metadata), then remote-generate (stages/remote_generate.py): reuse-load, prefill and
stream on the chosen prefill node, decode on the chosen decode node, through the node API.
Its trace export merges the nodes' spans of each request into one trace. Its kvdb admin views
(Hot, Replicas, Stats) are the nodes' own, asked at once and merged (kvdb/fanout.py): the
metadata records who holds a block, not whose it is, and only a node can filter by owner.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvflow.kvdb import AdminPeer, AdminPeers, StaticAdminSource
from kvflow.pipeline import (
    Metrics,
    Pipeline,
    PipelineConfig,
    ProcessTraces,
    Tracer,
    to_chrome_trace_by_process,
    traces_from_dict,
)
from kvflow.replication import RemoteMetadata
from kvflow.router import Conductor, InstanceState, MetadataPrefixIndex, RouterConfig
from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_aio_channel
from kvflow.stages.api import node_pb2, node_pb2_grpc
from kvflow.stages.api.convert import layout_from_info
from kvflow.stages.api.generation import of_tenant
from kvflow.stages.api.limits import TenantLimits
from kvflow.stages.api.node_guard import NodeGuard
from kvflow.stages.engine import GrammarCompiler, ModelCard, Tokenizer
from kvflow.stages.hash import HashStage
from kvflow.stages.remote_generate import RemoteGenerateStage
from kvflow.stages.route import RouteStage
from kvflow.stages.runtime.peers import parse_node_address
from kvflow.stages.serve.build import build_admission, build_conductor
from kvflow.stages.serve.config import RouterSettings
from kvflow.stages.serve.metrics import ServingMetrics
from kvflow.stages.tokenize import TokenizeStage

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 30.0  # one node's FlushCache (a shard's removals, DRAM and SSD)


class NodeFlushError(Exception):
    """Some nodes did not flush their cache (the message names them)."""


REFRESH_S = 1.0
TCP_BYTES_PER_S = 1.5e9


@dataclass
class RemoteNode:
    """A node as the router sees it (stages.remote_generate.NodeRef)."""

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
        self.channel = cluster_aio_channel(self.control, process_secret())
        self.stub = node_pb2_grpc.NodeStub(self.channel)


class RouterServer:
    """Build with ``RouterServer(settings)``; ``await start()``; ``await stop()``. Serves the
    inference API's Frontend protocol (api/inference.py) like the embedded server."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.model_dir = settings.model_dir
        self.tokenizer = Tokenizer.from_dir(settings.model_dir)
        self.card = ModelCard.from_dir(settings.model_dir)
        self.model_name = settings.served_model_name or self.card.name
        self.metadata = RemoteMetadata(list(settings.meta))
        self.metadata.start()
        self.prefill: dict[str, RemoteNode] = {}
        self.decode: dict[str, RemoteNode] = {}
        self.model_fingerprint = ""  # the first prefill node's, once started: every node's
        self.tracer = Tracer(settings.trace_capacity)
        self.metrics = Metrics()
        self.serving_metrics = ServingMetrics(self.metrics)
        self.tenant_limits = TenantLimits.from_config(settings)  # every front's admission
        self.admission = build_admission(settings, self.metrics)  # the waiting queue
        self._node_failures = self.metrics.counter(
            "node_failures", "Calls to a node that failed (the request was routed again)", ["node"]
        )
        self._node_busy = self.metrics.counter(
            "node_busy",
            "Calls a node refused for lack of room (the request went to another or waited)",
            ["node"],
        )
        self._instance_waits = self.metrics.counter(
            "instance_waits", "Requests that found no healthy prefill or decode node and waited"
        )
        self.failures_total = 0
        self.waits_total = 0
        self.node_guard = NodeGuard()  # deadlines, breakers, hung-node cancellation
        self.config = settings  # default_max_tokens / max_tokens_limit for the service
        self.admin_peers = AdminPeers(self._admin_peers)  # kvdb views asked of the nodes

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
        await self._refresh()  # nodes of another model or dtype out before the first request
        self.max_model_len = info.max_model_len
        self.block_size = info.block_size
        self.layout = layout_from_info(info)
        # Grammars are checked (compiled) here before routing; decode nodes apply them.
        self.grammars = GrammarCompiler.for_tokenizer(
            self.tokenizer.inner, info.vocab_size, self.card.eos_token_ids
        )
        s = self.settings
        self.conductor: Conductor = build_conductor(
            RouterConfig(
                policy=s.policy,
                ttft_slo_s=s.ttft_slo_s,
                tbt_slo_s=s.tbt_slo_s,
                balancing_threshold=s.balancing_threshold,
                block_size=info.block_size,
                block_nbytes=info.page_nbytes,
                seed=s.seed,
            ),
            self.model_dir,
            info.model_fingerprint,
            MetadataPrefixIndex(self.metadata.view()),
            TCP_BYTES_PER_S,
        )
        self.pipeline = Pipeline(
            [
                TokenizeStage(self.tokenizer, info.vocab_size, info.max_model_len),
                HashStage(info.model_fingerprint, self.layout),
                RouteStage(
                    self.conductor,
                    self.prefill,
                    self.decode,
                    instance_wait_s=s.instance_wait_s,
                    on_wait=self.count_wait,
                ),
                RemoteGenerateStage(
                    self.node_guard,
                    lambda: self.conductor,
                    lambda: (self.prefill, self.decode),
                    lambda: self.block_size,
                    s.instance_wait_s,
                    on_failed=self.mark_failed,
                    deadline=self.node_guard.budget.deadline,
                    on_wait=self.count_wait,
                    on_busy=self.count_busy,
                ),
            ],
            PipelineConfig(
                queue_size=256, default_concurrency=256, trace_capacity=s.trace_capacity
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
                    cluster_aio_channel(addresses[0], process_secret()),
                )
                group[info.node] = node
            elif node.control != addresses[0]:  # it came back elsewhere: keep its books
                node.ready = False
                await node.reconnect(addresses[0])
            polls.append((node, now - info.last_heartbeat < self.settings.node_dead_after_s))
        await asyncio.gather(*(self._poll(node, alive) for node, alive in polls))
        for node, _ in polls:  # calls in flight to a node marked unhealthy: retried elsewhere
            if not node.state.healthy:
                self.node_guard.cancel_node(node, "marked unhealthy")

    async def _poll(self, node: RemoteNode, alive: bool) -> None:
        """One ``Info`` call per live node per refresh. It is the readiness probe (a node is
        routable once it answers, and again after a failed call only once it answers again; a
        node that does not answer gets a fresh channel) and the node's own account of its
        load, every router's requests: what other routers sent there is added to this
        router's books (``set_reported_load``). A node whose model fingerprint (the weights
        and the dtype: a bf16 and an int8 node have KV pages of one layout but not the same
        values) is not the cluster's is never routed to."""
        if alive:
            try:
                info = await node.stub.Info(node_pb2.InfoRequest(), timeout=1.0)
            except grpc.aio.AioRpcError:
                if not node.ready:
                    await node.reconnect()
            else:
                expected = self.model_fingerprint
                if expected and info.model_fingerprint != expected:
                    if node.ready or not node.was_ready:
                        logger.error(
                            "router: node=%s serves model %s, not this cluster's %s (another "
                            "model or --dtype); not routing to it",
                            node.instance_id,
                            info.model_fingerprint,
                            expected,
                        )
                    node.ready, node.was_ready = False, True
                    node.state.set_healthy(False)
                    return
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

    def count_busy(self, node: RemoteNode) -> None:
        self._node_busy.labels(node=node.instance_id).inc()

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
        self.admin_peers.close()
        self.metadata.close()

    # -- what the inference service reads -------------------------------------------------------
    async def export_trace(self, last: int | None, tenant: str | None = None) -> dict[str, Any]:
        """The last requests' traces (of every tenant, or only of ``tenant``), each with the
        spans every node recorded for it: the router's own (tokenize, hash, route, generate)
        and the nodes' (reuse-load, prefill, stream on the prefill node; decode on the decode
        node), one process row per node, on wall-clock time. A node that does not answer is
        left out (logged)."""
        own = self.tracer.traces(last=last, where=of_tenant(tenant))
        ids = [t.request_id for t in own]
        rows = [ProcessTraces("router", tuple(own), time.time() - time.monotonic())]
        nodes = [*self.prefill.values(), *self.decode.values()]

        async def ask(node: RemoteNode) -> ProcessTraces | None:
            try:
                reply = await node.stub.ExportTrace(
                    node_pb2.NodeTraceRequest(request_ids=ids), timeout=5.0
                )
            except grpc.aio.AioRpcError as err:
                logger.warning("trace export: node=%s: %s", node.instance_id, err.details())
                return None
            traces = traces_from_dict(json.loads(reply.traces_json))
            return ProcessTraces(node.instance_id, tuple(traces), reply.wall_offset_s)

        answers = await asyncio.gather(*(ask(n) for n in nodes)) if ids else []
        rows += [a for a in answers if a is not None and a.traces]
        return to_chrome_trace_by_process(rows)

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

    async def flush_cache(self) -> int:
        """Every node's unpinned blocks removed (``Node.FlushCache`` on every prefill and
        decode node, at once); returns the blocks removed. Requests may run meanwhile: the
        blocks they pinned stay. A node that fails or does not answer within FLUSH_TIMEOUT_S
        is logged, and ``NodeFlushError`` names it once the others are flushed."""
        nodes = [*self.prefill.values(), *self.decode.values()]
        replies = await asyncio.gather(
            *(
                n.stub.FlushCache(node_pb2.FlushCacheRequest(), timeout=FLUSH_TIMEOUT_S)
                for n in nodes
            ),
            return_exceptions=True,
        )
        removed, failed = 0, []
        for node, reply in zip(nodes, replies, strict=True):
            if isinstance(reply, BaseException):
                detail = reply.details() if isinstance(reply, grpc.aio.AioRpcError) else reply
                logger.warning("flush_cache: node=%s failed: %s", node.instance_id, detail)
                failed.append(node.instance_id)
            else:
                removed += reply.removed
                logger.info(
                    "flush_cache: node=%s removed=%s pinned=%s",
                    node.instance_id,
                    reply.removed,
                    reply.pinned,
                )
        if failed:
            raise NodeFlushError(f"{removed} blocks removed; not flushed: {', '.join(failed)}")
        return removed

    def _admin_peers(self) -> list[AdminPeer]:
        """Every registered node's KVAdmin (its control port); read from an admin call's
        thread: a copy of the dicts' values is taken at once."""
        nodes = [*self.prefill.values(), *self.decode.values()]
        return [AdminPeer(n.instance_id, n.control) for n in nodes]

    def admin_source(self) -> StaticAdminSource:
        """No shards here: Nodes reads the metadata; Hot, Replicas and Stats ask the nodes."""
        return StaticAdminSource({}, self.metadata.view(), peers=self.admin_peers)
