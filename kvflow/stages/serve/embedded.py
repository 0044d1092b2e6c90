"""EmbeddedCluster: N prefill and M decode instances, one logical store, one process.

The composition root of `kvflow serve` (``--role embedded``): it opens the engines (one
EngineWorker thread each; with ``colocate``, prefill instance i and decode instance i share
one engine and its thread), a kvdb shard per instance over one single-replica Raft metadata
group, a transfer engine whose segments are the prefill page pools and the decode staging
areas, the conductor, and the seven-stage pipeline; the heartbeat and replicator loops are the
same as a node's (runtime/). The API servers are put in front of it by tools/serve.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import torch

from kvflow.kvdb import Namespace, Shard, ShardRef, StaticAdminSource
from kvflow.pipeline import Metrics, Pipeline, PipelineConfig, Tracer
from kvflow.replication import MetadataConfig, MetadataGroup, NodeId
from kvflow.router import InstanceState, Rejection, RouterConfig
from kvflow.stages.api.generation import of_tenant
from kvflow.stages.api.limits import TenantLimits
from kvflow.stages.decode import DecodeStage
from kvflow.stages.errors import InvalidArgument
from kvflow.stages.hash import HashStage, namespace_for
from kvflow.stages.prefill import PrefillStage
from kvflow.stages.reuse_load import ReuseLoadStage
from kvflow.stages.route import RouteStage
from kvflow.stages.runtime.heartbeat import Heartbeat, Member
from kvflow.stages.runtime.instances import DecodeInstance, PrefillInstance, pool_segment_name
from kvflow.stages.runtime.prefix_index import ShardPrefixIndex
from kvflow.stages.runtime.replicator import Replicator
from kvflow.stages.runtime.staging import StagingArea
from kvflow.stages.runtime.threads import embedded_threads
from kvflow.stages.runtime.worker import EngineWorker
from kvflow.stages.serve.build import (
    build_admission,
    build_conductor,
    ensure_model,
    kv_layout,
    open_engine,
    open_shard,
    prefill_prefault,
    tier_chores_when_idle,
)
from kvflow.stages.serve.closers import Closers
from kvflow.stages.serve.colocation import decode_staging_used, mixed_chunk, tbt_target_ms
from kvflow.stages.serve.config import ServeConfig
from kvflow.stages.serve.metrics import ServingMetrics, shard_hit_rates
from kvflow.stages.serve.ports import free_port
from kvflow.stages.stream import StreamStage
from kvflow.stages.tokenize import TokenizeStage
from kvflow.transfer import TransferConfig, TransferEngine

HEARTBEAT_S = 2.0
REPLICATE_S = 1.0

# Bandwidth the conductor assumes for in-process pulls until it has measured one.
LOCAL_COPY_BYTES_PER_S = 4e9


class EmbeddedCluster:
    """Build with ``EmbeddedCluster(config)``, then ``await start()`` / ``await stop()``.

    Public after construction: ``pipeline``, ``tracer``, ``metrics``, ``serving_metrics``,
    ``prefill`` and ``decode`` (id -> instance), ``conductor``, ``tokenizer``, ``model_dir``,
    ``card`` (the ModelCard), ``model_name`` (the served name),
    ``model_fingerprint``, ``layout``, ``max_model_len``.
    """

    def __init__(self, config: ServeConfig, metadata_port: int | None = None) -> None:
        self.config = config
        self.model_dir = ensure_model(config)
        self._closers = Closers()
        self._tasks: list[asyncio.Task[Any]] = []
        try:
            self._build(metadata_port)
        except BaseException:
            self.close_resources()
            raise

    # -- building ---------------------------------------------------------------------------
    def _build(self, metadata_port: int | None) -> None:
        c = self.config
        # colocated: one engine per prefill/decode pair, with the prefill's share of cores
        self._threads = embedded_threads(c.num_prefill, c.num_decode, c.colocate)
        self.transfer = TransferEngine(TransferConfig())
        self._closers.add(self.transfer.close)
        self.metadata = MetadataGroup(
            MetadataConfig(
                self_address=f"127.0.0.1:{metadata_port or free_port()}",
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
        self.card = first.card
        self.model_name = c.served_model_name or first.card.name
        self.model_fingerprint = first.model_fingerprint
        self.max_model_len = first.max_model_len
        self.vocab_size = first.spec.vocab_size
        self.layout = kv_layout(first)
        shared = list(self.prefill.values()) if c.colocate else []
        for i in range(c.num_decode):
            self._add_decode(f"decode-{i}", shared[i].worker if shared else None)
        # One grammar compiler (and cache) for the fronts and every engine: a request's grammar
        # is compiled once, off the event loop, before it is queued.
        self.grammars = first.grammars
        for inst in [*self.prefill.values(), *self.decode.values()]:
            inst.worker.engine.use_grammars(self.grammars)
        self.conductor = build_conductor(
            RouterConfig(
                policy=c.policy,
                ttft_slo_s=c.ttft_slo_s,
                tbt_slo_s=c.tbt_slo_s,
                balancing_threshold=c.balancing_threshold,
                block_size=c.block_size,
                block_nbytes=first.page_nbytes,
                seed=c.seed,
            ),
            self.model_dir,
            self.model_fingerprint,
            ShardPrefixIndex(self.prefill),
            LOCAL_COPY_BYTES_PER_S,
        )
        shards = {sid: shard for sid, (shard, _) in self.shards().items()}
        self.heartbeat = Heartbeat(
            self.metadata,
            [Member(sid, "embedded", kind, shard) for sid, (shard, kind) in self.shards().items()],
            HEARTBEAT_S,
        )
        self.tracer = Tracer(c.trace_capacity)
        self.metrics = Metrics()
        self.replicator = Replicator(self.metadata.view, shards, metrics=self.metrics)
        self.serving_metrics = ServingMetrics(self.metrics)
        self.tenant_limits = TenantLimits.from_config(c)  # every front's admission
        self.admission = build_admission(c, self.metrics)  # the waiting queue
        self.serving_metrics.track_hit_rates(
            {pid: shard_hit_rates(inst.store.shard) for pid, inst in self.prefill.items()}
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

    def _add_prefill(self, instance_id: str) -> None:
        c = self.config
        threads = self._threads["prefill"]
        # colocated: one engine holds both pools' pages (what the two engines would hold)
        engine_config = (
            replace(
                c,
                num_pages=2 * c.num_pages,
                mixed_chunk=mixed_chunk(True, c.mixed_chunk),
                tbt_target_ms=tbt_target_ms(c.tbt_target_ms),
            )
            if c.colocate
            else c
        )
        worker = open_engine(
            self.model_dir,
            engine_config,
            instance_id,
            self._closers,
            threads,
            prefault_pages=prefill_prefault(c),
        )
        engine = worker.engine
        store = open_shard(c, instance_id, engine, self.metadata, self._closers, False)
        tier_chores_when_idle(worker, store, c)
        pool = engine.host_pool  # the pages export_pages hands on (on a GPU: a host mirror)
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
            resident=engine.resident_pages(c.staging_pages),
        )
        self.prefill[instance_id] = PrefillInstance(instance_id, worker, store, state, load_staging)

    def _add_decode(self, instance_id: str, worker: EngineWorker | None = None) -> None:
        """A decode instance on its own engine, or on ``worker``'s (colocated with a prefill
        instance: the engine ids ``<request>/prefill`` and ``<request>/decode`` differ)."""
        c = self.config
        if worker is None:
            threads = self._threads["decode"]
            worker = open_engine(self.model_dir, c, instance_id, self._closers, threads)
        engine = worker.engine
        store = open_shard(c, instance_id, engine, self.metadata, self._closers, False)
        tier_chores_when_idle(worker, store, c)
        used = decode_staging_used(c.colocate, c.num_prefill, c.num_decode)
        staging = StagingArea(
            instance_id,
            c.staging_pages,
            engine.page_shape,
            engine.page_dtype,
            self.transfer,
            resident=engine.resident_pages(c.staging_pages) if used else 0,
        )
        state = InstanceState(instance_id, "decode")
        self.decode[instance_id] = DecodeInstance(instance_id, worker, state, staging, store)

    def _stages(self, engine: Any) -> list[Any]:
        c = self.config
        # colocated, the decode continues the prefill on the engine thread (decode.py)
        decode = DecodeStage(c.block_size, wait_for_prefill=True)
        return [
            TokenizeStage(self.tokenizer, self.vocab_size, self.max_model_len),
            HashStage(self.model_fingerprint, self.layout),
            RouteStage(
                self.conductor,
                self.prefill,
                self.decode,
                on_reject=self._on_reject,
                block_size=c.block_size,
            ),
            ReuseLoadStage(
                self.prefill,
                engine.page_shape,
                engine.page_dtype,
                c.block_size,
                peers={**self.prefill, **self.decode},
                metrics=self.metrics,
            ),
            PrefillStage(c.block_size, continuation=decode.continuation),
            StreamStage(self.transfer, self.pools, c.block_size),
            decode,
        ]

    def _on_reject(self, rejection: Rejection) -> None:
        self.serving_metrics.rejections.labels(reason=rejection.reason.value).inc()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def namespace(self, tenant: str) -> Namespace:
        return namespace_for(tenant, self.model_fingerprint, self.layout)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self.metadata.wait_ready(10.0)
        self.heartbeat.register_all()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.heartbeat.run()),
            loop.create_task(self.replicator.run(REPLICATE_S)),
        ]
        await self.pipeline.start()

    def shards(self) -> dict[str, tuple[Shard, str]]:
        """Every shard of the logical store: instance id -> (shard, "prefill" | "decode")."""
        out = {pid: (p.store.shard, "prefill") for pid, p in self.prefill.items()}
        out.update({did: (d.store.shard, "decode") for did, d in self.decode.items()})
        return out

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
        for task in self._tasks:
            task.cancel()
        await self.pipeline.stop(drain=drain, timeout_s=10.0)
        self.close_resources()

    def close_resources(self) -> None:
        """Stop engines, close shards (DRAM flushed to SSD), metadata and transfer. Idempotent."""
        self._closers.close_all()

    async def flush_cache(self) -> int:
        """Remove every block of every shard (SGLang's /flush_cache); only while no request
        runs (InvalidArgument otherwise). Returns the number of blocks removed."""
        if self.pipeline.in_flight():
            raise InvalidArgument("cache not flushed: requests are running")

        def flush() -> int:
            removed = 0
            for shard, _ in self.shards().values():
                removed += sum(1 for key, _tier in shard.holdings() if shard.remove(key))
            return removed

        return await asyncio.to_thread(flush)

    # -- introspection ----------------------------------------------------------------------
    async def export_trace(self, last: int | None, tenant: str | None = None) -> dict[str, Any]:
        """The Chrome/Perfetto document of the last requests (all in this process), of every
        tenant or only of ``tenant``."""
        from kvflow.pipeline import to_chrome_trace

        return to_chrome_trace(self.tracer.traces(last=last, where=of_tenant(tenant)))

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
