"""NodeServer: one prefill or decode node of a multi-process cluster (`kvflow serve --role node`).

A node holds one engine (its EngineWorker thread), its kvdb shard (metadata in the Raft group,
reached with RemoteMetadata), a transfer engine with a tcp server (its page pool or staging
area, and its shard's DRAM pool, are segments peers read and write), and one gRPC server with
the Node service (api/node.proto), the kvdb admin service and the BlockService.

A prefill node runs reuse-load, prefill and stream for each Prefill call on its own pipeline:
the prefix comes from its shard, then the longest continuation held by another node (read over
the transfer engine); the prompt's KV is written into the decode node's staging slots named in
the request. A decode node leases staging slots (Reserve) and runs the decode stage (Decode).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from kvflow.kvdb import (
    ADMIN_SERVICE_NAME,
    BLOCK_SERVICE_NAME,
    KVLayout,
    Namespace,
    ShardRef,
    StaticAdminSource,
    StoreConfig,
    add_admin_service,
    add_block_service,
    open_store,
)
from kvflow.pipeline import Pipeline, PipelineConfig
from kvflow.replication import NodeId, NodeLoad, RemoteMetadata, choose_source, choose_targets
from kvflow.router import InstanceState
from kvflow.stages.api import NODE_SERVICE_NAME, node_pb2_grpc
from kvflow.stages.api.node import STAGING_SEGMENT, NodeServicer
from kvflow.stages.decode import DecodeStage
from kvflow.stages.engine import Engine, EngineConfig
from kvflow.stages.prefill import PrefillStage
from kvflow.stages.reuse_load import ReuseLoadStage
from kvflow.stages.runtime.instances import (
    DecodeInstance,
    PrefillInstance,
    StagingArea,
    StagingLease,
    pool_segment_name,
)
from kvflow.stages.runtime.peers import RemotePeers, format_node_address
from kvflow.stages.runtime.worker import EngineWorker
from kvflow.stages.serve.closers import Closers
from kvflow.stages.stream import StreamStage
from kvflow.transfer import TransferConfig, TransferEngine

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class NodeConfig:
    """One node. ``kind`` is "prefill" or "decode"; ``meta`` the metadata replicas' gRPC
    addresses; ``port``/``transfer_port`` 0 pick free ports."""

    node_id: str
    kind: str
    model_dir: Path
    data_dir: Path
    meta: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    transfer_port: int = 0
    dtype: str = "float32"
    block_size: int = 64
    num_pages: int = 512
    prefill_chunk: int = 512
    staging_pages: int = 512
    dram_capacity_bytes: int = 1 << 30
    ssd_capacity_bytes: int = 8 << 30
    storage_engine: str = "rocksdb"
    lease_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("prefill", "decode"):
            raise ValueError(f"kind must be prefill or decode, got {self.kind!r}")
        if not self.node_id or "|" in self.node_id or "/" in self.node_id:
            raise ValueError(f"node_id must be a plain name, got {self.node_id!r}")
        if not self.meta:
            raise ValueError("meta: give the metadata replicas' gRPC addresses")


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class NodeServer:
    """Build with ``NodeServer(config)``; ``await start()`` serves; ``await stop()``."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._closers = Closers()
        try:
            self._build()
        except BaseException:
            self._close_resources()
            raise

    # -- building ---------------------------------------------------------------------------
    def _build(self) -> None:
        c = self.config
        engine = Engine.open(
            c.model_dir,
            EngineConfig(
                dtype=c.dtype,
                block_size=c.block_size,
                num_pages=c.num_pages,
                prefill_chunk=c.prefill_chunk,
                seed=c.seed,
            ),
        )
        self.engine = engine
        self.worker = EngineWorker(c.node_id, engine)
        self.worker.start()
        self._closers.add(self.worker.stop)
        lay = engine.kv_layout
        self.layout = KVLayout(
            lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.dtype
        )
        self.metadata = RemoteMetadata(list(c.meta))
        self.metadata.start()
        self._closers.add(self.metadata.close)
        self.metadata.wait_ready(30.0)
        self.transfer = TransferEngine(TransferConfig())
        self._closers.add(self.transfer.close)
        host, port = self.transfer.start_server(c.host, c.transfer_port)
        self.transfer_address = f"{host}:{port}"
        self.port = c.port or _free_port(c.host)
        self.address = f"{c.host}:{self.port}"
        # Register with the full address before the store opens: its re-adoption writes would
        # otherwise register the node implicitly, without an address peers can use.
        self.metadata.register_node(
            NodeId(c.node_id), format_node_address(self.address, self.transfer_address), c.kind
        )
        ns = Namespace("default", engine.model_fingerprint, self.layout)
        self.store = open_store(
            StoreConfig(
                data_dir=c.data_dir / "shards" / c.node_id,
                dram_capacity_bytes=c.dram_capacity_bytes,
                ssd_capacity_bytes=c.ssd_capacity_bytes,
                engine=c.storage_engine,
                value_size=engine.page_nbytes,
            ),
            ns,
            node_id=NodeId(c.node_id),
            metadata=self.metadata,
        )
        self._closers.add(self.store.close)
        self.state = InstanceState(c.node_id, c.kind)
        if c.kind == "prefill":
            self._build_prefill()
        else:
            self._build_decode()

    def _build_prefill(self) -> None:
        c, engine = self.config, self.engine
        pool = engine.pool_tensor
        self.transfer.register_memory(pool_segment_name(c.node_id), pool.view(torch.uint8).numpy())
        load = StagingArea(
            c.node_id, c.staging_pages, engine.page_shape, engine.page_dtype, None, name="load"
        )
        self.instance = PrefillInstance(c.node_id, self.worker, self.store, self.state, load)
        self.peers = RemotePeers(c.node_id, self.metadata, self.transfer)
        self._closers.add(self.peers.close)
        stages = [
            ReuseLoadStage(
                {}, engine.page_shape, engine.page_dtype, c.block_size, peers=self.peers
            ),
            PrefillStage(c.block_size),
            StreamStage(self.transfer, {c.node_id: pool}, c.block_size),
        ]
        self.pipeline = Pipeline(stages, PipelineConfig(queue_size=256, default_concurrency=64))

    def _build_decode(self) -> None:
        c, engine = self.config, self.engine
        self.staging = StagingArea(
            c.node_id,
            c.staging_pages,
            engine.page_shape,
            engine.page_dtype,
            self.transfer,
            name=STAGING_SEGMENT,
        )
        self.instance = DecodeInstance(c.node_id, self.worker, self.state, self.staging, self.store)
        self.leases: dict[str, tuple[StagingLease, float]] = {}
        self._lease_lock = threading.Lock()
        self.pipeline = Pipeline(
            [DecodeStage(c.block_size)], PipelineConfig(queue_size=256, default_concurrency=64)
        )

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        await self.pipeline.start()
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        node_pb2_grpc.add_NodeServicer_to_server(NodeServicer(self), self.server)
        source = StaticAdminSource(
            {c.node_id: ShardRef(self.store.shard, NodeId(c.node_id), c.kind)},
            self.metadata.view(),
        )
        add_admin_service(self.server, source)
        self.blocks = add_block_service(self.server, source, self.transfer)
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection(
            (NODE_SERVICE_NAME, ADMIN_SERVICE_NAME, BLOCK_SERVICE_NAME, reflection.SERVICE_NAME),
            self.server,
        )
        if self.server.add_insecure_port(self.address) == 0:
            raise OSError(f"cannot listen on {self.address}")
        await self.server.start()
        self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeats())

    async def _heartbeats(self) -> None:
        node = NodeId(self.config.node_id)
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                known = await asyncio.to_thread(self.metadata.heartbeat, node)
                if not known:  # dropped (or a new metadata group): re-register, re-adopt
                    await asyncio.to_thread(
                        self.metadata.register_node,
                        node,
                        format_node_address(self.address, self.transfer_address),
                        self.config.kind,
                    )
                    holdings = await asyncio.to_thread(self.store.shard.holdings)
                    await asyncio.to_thread(self.metadata.replace_holdings, node, holdings)
                if self.config.kind == "decode":
                    self._reap_leases()
                else:
                    await asyncio.to_thread(self.replicate_once)
            except Exception:
                logger.warning("node=%s heartbeat failed", node, exc_info=True)

    def replicate_once(self, limit: int = 256) -> int:
        """Act on replica targets: every prefill node computes the same placement from the
        metadata (``choose_targets`` over the live prefill nodes), and a node that is a
        target for a block it lacks reads it from a holder. Returns blocks copied."""
        view = self.metadata.view()
        wanted = view.under_replicated(limit)
        if not wanted:
            return 0
        now = time.time()
        loads = [
            NodeLoad(i.node, view.blocks_on(i.node), healthy=now - i.last_heartbeat < 5.0)
            for i in view.nodes()
            if i.kind == "prefill"
        ]
        me = NodeId(self.config.node_id)
        ns = Namespace("default", self.engine.model_fingerprint, self.layout)
        copied = 0
        for key, _count, target in wanted:
            holders = view.replicas(key)
            if me in holders or me not in choose_targets(holders, target, loads):
                continue
            source = choose_source(holders, [NodeId(p) for p in self.peers])
            if source is None:
                continue
            buf = torch.empty(self.engine.page_shape, dtype=self.engine.page_dtype)
            if self.peers[source].client(ns).batch_get_into([key], [buf])[0] is not None:
                copied += self.store.shard.put(key, buf) is not None
        if copied:
            logger.info("node=%s copied %d blocks toward their replica targets", me, copied)
        return copied

    async def stop(self) -> None:
        task = getattr(self, "_heartbeat", None)
        if task is not None:
            task.cancel()
        server = getattr(self, "server", None)
        if server is not None:
            await server.stop(1.0)
        await self.pipeline.stop(drain=False, timeout_s=5.0)
        blocks = getattr(self, "blocks", None)
        if blocks is not None:
            blocks.close()
        self._close_resources()

    def _close_resources(self) -> None:
        self._closers.close_all()

    # -- decode leases ----------------------------------------------------------------------
    def lease(self, request_id: str, n: int) -> tuple[str, StagingLease]:
        lease = self.staging.lease(n)
        lease_id = f"{request_id}:{uuid.uuid4().hex[:8]}"
        with self._lease_lock:
            self.leases[lease_id] = (lease, time.monotonic() + self.config.lease_timeout_s)
        return lease_id, lease

    def take_lease(self, lease_id: str) -> StagingLease | None:
        with self._lease_lock:
            entry = self.leases.pop(lease_id, None)
        return None if entry is None else entry[0]

    def _reap_leases(self) -> None:
        now = time.monotonic()
        with self._lease_lock:
            expired = [k for k, (_, deadline) in self.leases.items() if deadline < now]
            dropped = [self.leases.pop(k)[0] for k in expired]
        for lease in dropped:
            self.staging.release(lease)
        if dropped:
            logger.info(
                "node=%s released %d expired staging leases", self.config.node_id, len(dropped)
            )
