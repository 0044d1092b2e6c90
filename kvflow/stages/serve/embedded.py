"""EmbeddedCluster: N prefill and M decode instances, one logical store, one process.

The composition root of the serving path: it opens the engines (one EngineWorker thread each),
a kvdb shard per prefill instance over one single-replica Raft metadata group, a transfer
engine whose segments are the prefill page pools and the decode staging areas, the conductor,
and the seven-stage pipeline. ``kvflow serve`` puts the gRPC API in front of it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path
from typing import Any

import torch

from kvflow.kvdb import (
    KVLayout,
    Namespace,
    Shard,
    ShardRef,
    StaticAdminSource,
    Store,
    StoreConfig,
    open_store,
)
from kvflow.pipeline import Metrics, Pipeline, PipelineConfig, Tracer
from kvflow.replication import MetadataConfig, MetadataGroup, NodeId
from kvflow.router import (
    Conductor,
    InstanceState,
    Profile,
    ProfileMismatchError,
    RouterConfig,
    TransferEstimator,
    load_profile,
)
from kvflow.stages.decode import DecodeStage
from kvflow.stages.engine import Engine, EngineConfig, write_demo_model
from kvflow.stages.hash import HashStage
from kvflow.stages.prefill import PrefillStage
from kvflow.stages.reuse_load import ReuseLoadStage
from kvflow.stages.route import RouteStage
from kvflow.stages.runtime.instances import (
    DecodeInstance,
    PrefillInstance,
    StagingArea,
    pool_segment_name,
)
from kvflow.stages.runtime.prefix_index import ShardPrefixIndex
from kvflow.stages.runtime.replicator import Replicator
from kvflow.stages.runtime.worker import EngineWorker
from kvflow.stages.serve.closers import Closers
from kvflow.stages.serve.config import ServeConfig
from kvflow.stages.serve.metrics import ServingMetrics
from kvflow.stages.stream import StreamStage
from kvflow.stages.tokenize import TokenizeStage
from kvflow.transfer import TransferConfig, TransferEngine

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
REPLICATE_S = 1.0

# Bandwidth the conductor assumes for in-process pulls until it has measured one.
LOCAL_COPY_BYTES_PER_S = 4e9


def ensure_model(config: ServeConfig) -> Path:
    """The model directory to serve: ``config.model_dir``, or the small demo model written
    (once, seeded) under ``data_dir/models/small``."""
    if config.model_dir is not None:
        return config.model_dir
    path = config.data_dir / "models" / "small"
    if not (path / "config.json").exists():
        logger.info("writing the small demo model to %s (first run)", path)
        write_demo_model(path, preset="small", seed=config.seed)
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedCluster:
    """Build with ``EmbeddedCluster(config)``, then ``await start()`` / ``await stop()``.

    Public after construction: ``pipeline``, ``tracer``, ``metrics``, ``serving_metrics``,
    ``prefill`` and ``decode`` (id -> instance), ``conductor``, ``tokenizer``, ``model_dir``,
    ``model_fingerprint``, ``layout``, ``max_model_len``.
    """

    def __init__(self, config: ServeConfig, metadata_port: int | None = None) -> None:
        self.config = config
        self.model_dir = ensure_model(config)
        self._closers = Closers()
        try:
            self._build(metadata_port)
        except BaseException:
            self.close_resources()
            raise

    # -- building ---------------------------------------------------------------------------
    def _engine_config(self) -> EngineConfig:
        c = self.config
        return EngineConfig(
            dtype=c.dtype,
            block_size=c.block_size,
            num_pages=c.num_pages,
            prefill_chunk=c.prefill_chunk,
            max_batch=c.max_batch,
            seed=c.seed,
        )

    def _open_engine(self, instance_id: str) -> EngineWorker:
        engine = Engine.open(self.model_dir, self._engine_config())
        worker = EngineWorker(instance_id, engine)
        worker.start()
        self._closers.add(worker.stop)
        return worker

    def _build(self, metadata_port: int | None) -> None:
        c = self.config
        self.transfer = TransferEngine(TransferConfig())
        self._closers.add(self.transfer.close)
        self.metadata = MetadataGroup(
            MetadataConfig(
                self_address=f"127.0.0.1:{metadata_port or _free_port()}",
                journal_dir=c.data_dir / "meta",
            )
        )
        self.metadata.start()
        self._closers.add(self.metadata.close)
        self.prefill: dict[str, PrefillInstance] = {}
        self.decode: dict[str, DecodeInstance] = {}
        self.pools: dict[str, torch.Tensor] = {}
        for i in range(c.num_prefill):
            self._add_prefill(f"prefill-{i}")
        first = next(iter(self.prefill.values())).worker.engine
        self.tokenizer = first.tokenizer
        self.model_fingerprint = first.model_fingerprint
        self.max_model_len = first.max_model_len
        self.vocab_size = first.spec.vocab_size
        for i in range(c.num_decode):
            self._add_decode(f"decode-{i}")
        self.conductor = self._conductor(first)
        self.replicator = Replicator(
            {sid: shard for sid, (shard, _) in self.shards().items()},
            self.metadata.view(),
            targets=list(self.prefill),
        )
        self.tracer = Tracer(c.trace_capacity)
        self.metrics = Metrics()
        self.serving_metrics = ServingMetrics(self.metrics)
        self.serving_metrics.track_hit_rates(
            {pid: _hit_rates(inst) for pid, inst in self.prefill.items()}
        )
        self.pipeline = Pipeline(
            self._stages(first),
            PipelineConfig(
                queue_size=c.queue_size,
                default_concurrency=max(64, c.queue_size),
                trace_capacity=c.trace_capacity,
                default_deadline_s=c.request_timeout_s,
            ),
            tracer=self.tracer,
            metrics=self.metrics,
        )

    def _layout(self, engine: Engine) -> KVLayout:
        lay = engine.kv_layout
        return KVLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.dtype)

    def _add_prefill(self, instance_id: str) -> None:
        c = self.config
        worker = self._open_engine(instance_id)
        engine = worker.engine
        self.layout = self._layout(engine)
        store = self._open_store(instance_id, engine)
        pool = engine.pool_tensor
        self.transfer.register_memory(
            pool_segment_name(instance_id), pool.view(torch.uint8).numpy()
        )
        self.pools[instance_id] = pool
        state = InstanceState(instance_id, "prefill")
        load_staging = StagingArea(
            instance_id,
            c.staging_pages,
            engine.page_shape,
            engine.page_dtype,
            None,
            name=f"{instance_id}/load",
        )
        self.prefill[instance_id] = PrefillInstance(instance_id, worker, store, state, load_staging)

    def _open_store(self, instance_id: str, engine: Engine) -> Store:
        """The instance's kvdb shard under ``data_dir/shards/<instance>``, in the metadata."""
        c = self.config
        namespace = Namespace("default", engine.model_fingerprint, self.layout)
        store = open_store(
            StoreConfig(
                data_dir=c.data_dir / "shards" / instance_id,
                dram_capacity_bytes=c.dram_capacity_bytes,
                ssd_capacity_bytes=c.ssd_capacity_bytes,
                engine=c.storage_engine,
                value_size=engine.page_nbytes,
            ),
            namespace,
            node_id=NodeId(instance_id),
            metadata=self.metadata,
        )
        self._closers.add(store.close)
        return store

    def _add_decode(self, instance_id: str) -> None:
        worker = self._open_engine(instance_id)
        engine = worker.engine
        store = self._open_store(instance_id, engine)
        staging = StagingArea(
            instance_id,
            self.config.staging_pages,
            engine.page_shape,
            engine.page_dtype,
            self.transfer,
        )
        state = InstanceState(instance_id, "decode")
        self.decode[instance_id] = DecodeInstance(instance_id, worker, state, staging, store)

    def _conductor(self, engine: Engine) -> Conductor:
        c = self.config
        try:
            profile = load_profile(self.model_dir, model_id=engine.model_fingerprint)
        except ProfileMismatchError as exc:
            logger.warning("%s; using the default time models", exc)
            profile = Profile.default()
        if profile.is_default:
            logger.warning(
                "no kvflow_profile.json in %s: the conductor uses default time models; "
                "run `kvflow profile --model %s` for fitted ones",
                self.model_dir,
                self.model_dir,
            )
        router_config = RouterConfig(
            policy=c.policy,
            ttft_slo_s=c.ttft_slo_s,
            tbt_slo_s=c.tbt_slo_s,
            balancing_threshold=c.balancing_threshold,
            block_size=c.block_size,
            block_nbytes=engine.page_nbytes,
            seed=c.seed,
        )
        return Conductor(
            router_config,
            ShardPrefixIndex(self.prefill),
            profile.prefill,
            profile.decode,
            TransferEstimator(LOCAL_COPY_BYTES_PER_S),
        )

    def _stages(self, engine: Engine) -> list[Any]:
        c = self.config
        return [
            TokenizeStage(self.tokenizer, self.vocab_size, self.max_model_len),
            HashStage(self.model_fingerprint, self.layout),
            RouteStage(self.conductor, self.prefill, self.decode, on_reject=self._on_reject),
            ReuseLoadStage(
                self.prefill,
                engine.page_shape,
                engine.page_dtype,
                c.block_size,
                peers={**self.prefill, **self.decode},
            ),
            PrefillStage(c.block_size),
            StreamStage(self.transfer, self.pools, c.block_size),
            DecodeStage(c.block_size),
        ]

    def _on_reject(self, rejection: Any) -> None:
        self.serving_metrics.rejections.labels(reason=rejection.reason.value).inc()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self.metadata.wait_ready(10.0)
        for sid, (_, kind) in self.shards().items():
            self.metadata.register_node(NodeId(sid), "embedded", kind, time.time())
        self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeats())
        self._replicating = asyncio.get_running_loop().create_task(self._replicate())
        await self.pipeline.start()

    async def _heartbeats(self) -> None:
        """Keep the shards' nodes alive in the metadata (a node that was dropped re-adopts
        what its shard holds)."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            for sid, (shard, _) in self.shards().items():
                try:
                    known = await asyncio.to_thread(
                        self.metadata.heartbeat, NodeId(sid), time.time()
                    )
                    if not known:
                        holdings = await asyncio.to_thread(shard.holdings)
                        await asyncio.to_thread(
                            self.metadata.replace_holdings, NodeId(sid), holdings, time.time()
                        )
                except Exception:
                    logger.warning("node=%s heartbeat failed", sid, exc_info=True)

    def shards(self) -> dict[str, tuple[Shard, str]]:
        """Every shard of the logical store: instance id -> (shard, "prefill" | "decode")."""
        out = {pid: (p.store.shard, "prefill") for pid, p in self.prefill.items()}
        out.update({did: (d.store.shard, "decode") for did, d in self.decode.items()})
        return out

    async def _replicate(self) -> None:
        """Act on replica targets (``change_replica``): copy blocks between the shards."""
        while True:
            await asyncio.sleep(REPLICATE_S)
            try:
                await asyncio.to_thread(self.replicator.run_once)
            except Exception:
                logger.warning("replicator pass failed", exc_info=True)

    def admin_source(self) -> StaticAdminSource:
        """What the kvdb admin service (``kvflow kvdb``) reads: every shard + the metadata."""
        return StaticAdminSource(
            {
                sid: ShardRef(shard, NodeId(sid), kind)
                for sid, (shard, kind) in self.shards().items()
            },
            self.metadata.view(),
        )

    async def stop(self, drain: bool = False) -> None:
        for name in ("_heartbeat", "_replicating"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        await self.pipeline.stop(drain=drain, timeout_s=10.0)
        self.close_resources()

    def close_resources(self) -> None:
        """Stop engines, close shards (DRAM flushed to SSD), metadata and transfer. Idempotent."""
        self._closers.close_all()

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Router counters and per-instance values for the Stats RPC."""
        instances = []
        for pid, p in self.prefill.items():
            values = {
                "queued_requests": float(p.state.queued_requests),
                "queued_seconds": p.state.queued_seconds(),
                "engine_steps": float(p.worker.steps),
                "free_pages": float(p.worker.engine.num_free_pages),
            }
            instances.append((pid, "prefill", values | _shard_values(p.store.shard)))
        for did, d in self.decode.items():
            values = {
                "decode_batch": float(d.state.decode_batch_size),
                "engine_steps": float(d.worker.steps),
                "free_pages": float(d.worker.engine.num_free_pages),
                "free_staging_pages": float(d.staging.num_free),
            }
            instances.append((did, "decode", values | _shard_values(d.store.shard)))
        router = {
            "in_flight": float(self.pipeline.in_flight()),
            "metadata_blocks": float(self.metadata.view().num_blocks()),
            "replicator_copies": float(self.replicator.copied),
        }
        return {"router": router, "instances": instances}


def _shard_values(shard: Shard) -> dict[str, float]:
    s = shard.stats()
    values: dict[str, float] = {}
    for tier_name, t in (("dram", s.dram), ("ssd", s.ssd)):
        values[f"{tier_name}_hits"] = float(t.hits)
        values[f"{tier_name}_misses"] = float(t.misses)
        values[f"{tier_name}_blocks"] = float(t.blocks)
        values[f"{tier_name}_used_bytes"] = float(t.used_bytes)
        values[f"{tier_name}_evictions"] = float(t.evictions)
    return values


def _hit_rates(inst: PrefillInstance) -> Any:
    def rates() -> dict[str, float]:
        s = inst.store.shard.stats()
        return {"dram": s.dram.hit_rate, "ssd": s.ssd.hit_rate}

    return rates


def namespace_for(cluster: EmbeddedCluster, tenant: str) -> Namespace:
    return Namespace(tenant, cluster.model_fingerprint, cluster.layout)
