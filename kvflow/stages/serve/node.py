"""NodeServer: one prefill or decode node of a multi-process cluster (`kvflow serve --role node`).

A node holds one engine (its EngineWorker thread), its kvdb shard (metadata in the Raft group,
reached with RemoteMetadata), a transfer engine with a tcp server (its page pool or staging
area, and its shard's DRAM pool, are segments peers read and write), one gRPC server with the
Node service (api/node.py), the kvdb admin service and the BlockService, and a Prometheus
metrics endpoint.

A prefill node runs reuse-load, prefill and stream for each Prefill call on its own pipeline;
a decode node leases staging slots (Reserve) and runs the decode stage (Decode). Every node
heartbeats (runtime/heartbeat.py); a prefill node also acts on replica targets
(runtime/replicator.py); a decode node frees staging leases nobody took.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
import numpy as np
import torch

from kvflow.kvdb import (
    ADMIN_SERVICE_NAME,
    BLOCK_SERVICE_NAME,
    DEFAULT_TENANT,
    PeerBreakers,
    ReplicaWriter,
    ShardRef,
    StaticAdminSource,
    add_admin_service,
    add_block_service,
)
from kvflow.pipeline import Metrics, Pipeline, PipelineConfig, Tracer
from kvflow.replication import NodeId, RemoteMetadata
from kvflow.router import InstanceState
from kvflow.security import process_secret
from kvflow.security.grpc_auth import aio_cluster_interceptors
from kvflow.security.tls import add_port
from kvflow.stages.api import NODE_SERVICE_NAME, node_pb2_grpc
from kvflow.stages.api.node import NodeServicer
from kvflow.stages.decode import DecodeStage
from kvflow.stages.hash import namespace_for
from kvflow.stages.prefill import PrefillStage
from kvflow.stages.reuse_load import ReuseLoadStage
from kvflow.stages.runtime.heartbeat import Heartbeat, Member, server_clock
from kvflow.stages.runtime.instances import DecodeInstance, PrefillInstance, pool_segment_name
from kvflow.stages.runtime.peers import RemotePeers, format_node_address
from kvflow.stages.runtime.pins import PinBook
from kvflow.stages.runtime.replicator import BlockCopy, Replicator
from kvflow.stages.runtime.staging import STAGING_SEGMENT, LeaseBook, StagingArea
from kvflow.stages.serve.build import (
    ensure_model,
    kv_layout,
    open_engine,
    open_shard,
    prefill_prefault,
    tier_chores_when_idle,
)
from kvflow.stages.serve.closers import Closers
from kvflow.stages.serve.config import NodeConfig
from kvflow.stages.serve.metrics import ServingMetrics, shard_hit_rates
from kvflow.stages.serve.ports import free_port
from kvflow.stages.stream import StreamStage
from kvflow.transfer import TransferConfig, TransferEngine

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
REPLICATE_S = 1.0
PIN_REAP_S = 0.5
REPLICA_PEER_DEAD_S = 5.0  # a peer silent this long takes no pushed copies (as the replicator)


class NodeServer:
    """Build with ``NodeServer(config)``; ``await start()`` serves; ``await stop()``.
    Implements api.node.NodeCore."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.kind = config.kind
        self.leases: LeaseBook | None = None
        self.pins: PinBook | None = None
        self._closers = Closers()
        self._tasks: list[asyncio.Task[Any]] = []
        try:
            self._build()
        except BaseException:
            self._closers.close_all()
            raise

    # -- building ---------------------------------------------------------------------------
    def _build(self) -> None:
        c = self.config
        self.model_dir = ensure_model(c)
        prefault = prefill_prefault(c) if c.kind == "prefill" else None
        self.worker = open_engine(
            self.model_dir, c, c.node_id, self._closers, prefault_pages=prefault
        )
        self.engine = engine = self.worker.engine
        self.layout = kv_layout(engine)
        self.model_fingerprint = engine.model_fingerprint
        self.page_nbytes = engine.page_nbytes
        self.metadata = RemoteMetadata(list(c.meta))
        self.metadata.start()
        self._closers.add(self.metadata.close)
        self.metadata.wait_ready(30.0)
        self.transfer = TransferEngine(TransferConfig())
        self._closers.add(self.transfer.close)
        host, port = self.transfer.start_server(c.host, c.transfer_port)
        self.transfer_address = f"{host}:{port}"
        self.port = c.port or free_port(c.host)
        self.address = f"{c.host}:{self.port}"
        self.metrics = Metrics()
        self.tracer = Tracer(c.trace_capacity)
        self.state = InstanceState(c.node_id, c.kind)
        # Register with the full address before the store opens: its re-adoption writes would
        # otherwise register the node implicitly, without an address peers can use.
        address = format_node_address(self.address, self.transfer_address)
        self.metadata.register_node(NodeId(c.node_id), address, c.kind)
        self.store = open_shard(c, c.node_id, engine, self.metadata, self._closers)
        tier_chores_when_idle(self.worker, self.store, c)
        ServingMetrics(self.metrics).track_hit_rates({c.node_id: shard_hit_rates(self.store.shard)})
        self.heartbeat = Heartbeat(
            self.metadata,
            [Member(c.node_id, address, c.kind, self.store.shard)],
            HEARTBEAT_S,
            clock=server_clock,
        )
        self.heartbeat.mark_ok()  # registered above
        # one breaker per peer for every call of this node (block reads, the KV stream)
        self.peer_breakers = PeerBreakers(c.peer_budget)
        self.peers = RemotePeers(c.node_id, self.metadata, self.transfer, self.peer_breakers)
        self._closers.add(self.peers.close)
        if c.kind == "prefill":
            self._build_prefill()
        else:
            self._build_decode()

    def _pipeline(self, stages: list[Any]) -> Pipeline:
        return Pipeline(
            stages,
            PipelineConfig(
                queue_size=256, default_concurrency=64, trace_capacity=self.config.trace_capacity
            ),
            tracer=self.tracer,
            metrics=self.metrics,
        )

    def _build_prefill(self) -> None:
        c, engine = self.config, self.engine
        pool = engine.host_pool  # the pages export_pages hands on (on a GPU: a host mirror)
        self.transfer.register_memory(pool_segment_name(c.node_id), pool.view(torch.uint8).numpy())
        load = StagingArea(
            c.node_id,
            c.staging_pages,
            engine.page_shape,
            engine.page_dtype,
            None,
            name="load",
            resident=engine.resident_pages(c.staging_pages),
        )
        self.instance: PrefillInstance | DecodeInstance = PrefillInstance(
            c.node_id, self.worker, self.store, self.state, load
        )
        self.pins = PinBook(self.store.shard)
        self.replicator = Replicator(
            self.metadata.view,
            {c.node_id: self.store.shard},
            remote=self._read_remote,
            remote_nodes=lambda: list(self.peers),
            metrics=self.metrics,
        )
        self.pipeline = self._pipeline(
            [
                ReuseLoadStage(
                    self.peers,
                    engine.page_shape,
                    engine.page_dtype,
                    c.block_size,
                    self.peers,
                    metrics=self.metrics,
                ),
                PrefillStage(c.block_size),
                StreamStage(self.transfer, {c.node_id: pool}, c.block_size, self.peer_breakers),
            ]
        )

    def _read_remote(self, source: NodeId, key: bytes) -> BlockCopy | None:
        """One block of another node, read over the transfer engine, with the parent and
        owner tenant its holder reports (the replicator's source when no holder is in this
        process)."""
        ns = namespace_for("", self.model_fingerprint, self.layout)
        reader = self.peers[source].client(ns)
        lease = reader.lease([key])
        try:
            # the holder's size, whatever it is (a page, or another member's object)
            bufs = [np.empty(b.length, dtype=np.uint8) for b in lease.blocks[:1]]
            got = reader.read_into(lease, bufs) if bufs else []
        finally:
            reader.release_async(lease)
        if not got or got[0] is None:
            return None
        buf = bufs[0]
        block = lease.blocks[0]
        return BlockCopy(buf, block.parent, block.tenant or DEFAULT_TENANT)

    def _build_decode(self) -> None:
        c, engine = self.config, self.engine
        staging = StagingArea(
            c.node_id,
            c.staging_pages,
            engine.page_shape,
            engine.page_dtype,
            self.transfer,
            name=STAGING_SEGMENT,
            resident=engine.resident_pages(c.staging_pages),
        )
        self.leases = LeaseBook(staging, c.lease_timeout_s)
        self.instance = DecodeInstance(c.node_id, self.worker, self.state, staging, self.store)
        self.pipeline = self._pipeline([DecodeStage(c.block_size, wait_for_prefill=False)])

    # -- what the Node service reads ----------------------------------------------------------
    def info(self) -> dict[str, Any]:
        e, lay = self.engine, self.layout
        return {
            "node_id": self.node_id,
            "kind": self.kind,
            "model_fingerprint": e.model_fingerprint,
            "block_size": e.block_size,
            "page_nbytes": e.page_nbytes,
            "transfer_address": self.transfer_address,
            "max_model_len": e.max_model_len,
            "vocab_size": e.spec.vocab_size,
            "active_requests": self.worker.num_active,
            "free_pages": e.num_free_pages,
            "free_staging": self.leases.staging.num_free if self.leases is not None else 0,
            "num_layers": lay.num_layers,
            "num_kv_heads": lay.num_kv_heads,
            "head_dim": lay.head_dim,
            "dtype": lay.dtype,
            "control_address": self.address,
            "queued_prefill_s": self.state.queued_seconds(time.monotonic()),
            "decode_batch_size": self.state.decode_batch_size,
            "decode_context_tokens": self.state.decode_context_tokens,
        }

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        await self.pipeline.start()
        # Every RPC of a node (Node, KVAdmin, BlockService) is intra-cluster: the cluster
        # token is required; no SO_REUSEPORT, so a busy port is an error, not a shared port.
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)],
            interceptors=aio_cluster_interceptors(process_secret()),
        )
        node_pb2_grpc.add_NodeServicer_to_server(NodeServicer(self), self.server)
        source = StaticAdminSource(
            {c.node_id: ShardRef(self.store.shard, NodeId(c.node_id), c.kind)},
            self.metadata.view(),
        )
        add_admin_service(self.server, source)
        # takes pushed copies (recorded in the metadata before it answers), and pushes its
        # own: store.client().put(..., replicas=N) returns once N nodes of its kind hold it
        self.blocks = add_block_service(
            self.server, source, self.transfer, record=self.store.flush_metadata
        )
        self.store.replica_writer = ReplicaWriter(
            NodeId(c.node_id),
            self.metadata,
            self.store.flush_metadata,
            kinds=frozenset({c.kind}),
            dead_after_s=REPLICA_PEER_DEAD_S,
            clock=server_clock,
        )
        self._closers.add(self.store.replica_writer.close)
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection(
            (NODE_SERVICE_NAME, ADMIN_SERVICE_NAME, BLOCK_SERVICE_NAME, reflection.SERVICE_NAME),
            self.server,
        )
        if add_port(self.server, self.address, None) == 0:  # TLS when configured
            raise OSError(f"cannot listen on {self.address}")
        await self.server.start()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.heartbeat.run()))
        if self.kind == "prefill":
            self._tasks.append(loop.create_task(self.replicator.run(REPLICATE_S)))
            self._tasks.append(loop.create_task(self._reap_pins()))
        else:
            self._tasks.append(loop.create_task(self._reap_leases()))

    async def _reap_leases(self) -> None:
        assert self.leases is not None
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            self.leases.reap()

    async def _reap_pins(self) -> None:
        assert self.pins is not None
        while True:
            await asyncio.sleep(PIN_REAP_S)
            self.pins.reap(time.monotonic())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        server = getattr(self, "server", None)
        if server is not None:
            await server.stop(1.0)
        await self.pipeline.stop(drain=False, timeout_s=5.0)
        blocks = getattr(self, "blocks", None)
        if blocks is not None:
            blocks.close()
        self._closers.close_all()
