"""What every server role builds the same way, decided once: the model directory, an engine
and its worker thread, the KV layout, a kvdb shard, the conductor (with its time models and
the one warning when none was measured), and free ports."""

from __future__ import annotations

import logging
from pathlib import Path

from kvflow.kvdb import KVLayout, Store, StoreConfig, open_store
from kvflow.kvdb.manifest import engine_for
from kvflow.pipeline import AdmissionConfig, AdmissionQueue, Metrics
from kvflow.replication import NodeId
from kvflow.router import (
    Conductor,
    PrefixIndex,
    Profile,
    ProfileMismatchError,
    RouterConfig,
    TransferEstimator,
    load_profile,
)
from kvflow.stages.engine import Engine, EngineConfig, openmp, write_demo_model
from kvflow.stages.hash import DEFAULT_TENANT, namespace_for
from kvflow.stages.runtime.threads import EngineThreads
from kvflow.stages.runtime.worker import EngineWorker
from kvflow.stages.serve.closers import Closers
from kvflow.stages.serve.config import EngineStoreConfig, RoutingConfig

logger = logging.getLogger(__name__)


def build_admission(config: RoutingConfig, metrics: Metrics) -> AdmissionQueue:
    """The admission queue of a process that serves the inference API (embedded, router)."""
    return AdmissionQueue(
        AdmissionConfig(
            max_queued_requests=config.max_queued_requests,
            max_queued_tokens=config.max_queued_tokens,
            max_running=config.max_running_requests,
            queue_timeout_s=config.queue_timeout_s,
        ),
        metrics,
    )


def ensure_model(config: EngineStoreConfig) -> Path:
    """The model directory to serve: ``config.model_dir``, or the small demo model written
    (once, seeded) under ``data_dir/models/small``."""
    if config.model_dir is not None:
        return config.model_dir
    path = config.data_dir / "models" / "small"
    if not (path / "config.json").exists():
        logger.info("writing the small demo model to %s (first run)", path)
        write_demo_model(path, preset="small", seed=config.seed)
    return path


def open_engine(
    model_dir: Path,
    config: EngineStoreConfig,
    instance_id: str,
    closers: Closers,
    intra_op_threads: int | EngineThreads | None = None,
    prefault_pages: int | None = None,
) -> EngineWorker:
    """An engine on ``model_dir`` behind its started worker thread (stopped by ``closers``),
    whose forward passes use ``intra_op_threads`` (None: the process's default count). Only
    the worker thread builds an OpenMP team (``openmp.reserve``). ``prefault_pages``: the
    pool's leading pages written at open (`EngineConfig.prefault_pages`; None: one
    sequence's); the callers give ``prefill_prefault(config)`` to the engine that prefills."""
    closers.add(openmp.reserve())
    engine = Engine.open(
        model_dir,
        EngineConfig(
            dtype=config.dtype,
            block_size=config.block_size,
            num_pages=config.num_pages,
            prefill_chunk=config.prefill_chunk,
            mixed_chunk=config.mixed_chunk,
            tbt_target_ms=config.tbt_target_ms or None,  # 0: none
            max_batch=config.max_batch,
            seed=config.seed,
            device=config.device,
            prefault_pages=prefault_pages,
        ),
    )
    worker = EngineWorker(instance_id, engine, intra_op_threads=intra_op_threads)
    worker.start()
    closers.add(worker.stop)
    return worker


def prefill_prefault(config: EngineStoreConfig) -> int | None:
    """The KV pages a process writes at start in the pool of the engine that prefills (with
    ``kv_prefault``): one memory-planned pool's, ``config.num_pages`` (at most 1/16 of the
    available memory), whether that engine also decodes (colocated, holding two pools'
    pages) or not; a decode engine's pool maps as used. None without ``kv_prefault``."""
    return config.num_pages if config.kv_prefault else None


def tier_chores_when_idle(worker: EngineWorker, store: Store, config: EngineStoreConfig) -> None:
    """Have ``worker``'s thread tend ``store``'s tiers while its engine is idle: the engine
    whose steps this work would otherwise share cores with, at the times it leaves them free.
    Map the DRAM tier ahead of its stores (``kvdb/dram.py``,
    ``EngineStoreConfig.dram_write_ahead_bytes``) and write to SSD the blocks the next
    evictions would demote (``kvdb/mover.py``, ``EngineStoreConfig.dram_write_behind``)."""
    if config.dram_write_ahead_bytes and not config.dram_prefault:
        worker.add_idle_task(store.shard.write_ahead)
    if config.dram_write_behind:
        worker.add_idle_task(store.shard.write_behind)


def kv_layout(engine: Engine) -> KVLayout:
    """kvdb's layout of the engine's KV pages (part of every Namespace)."""
    lay = engine.kv_layout
    return KVLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.dtype)


def open_shard(
    config: EngineStoreConfig,
    instance_id: str,
    engine: Engine,
    metadata: object,
    closers: Closers,
    shared_dram: bool = True,
) -> Store:
    """The instance's kvdb shard under ``data_dir/shards/<instance>``, reporting to
    ``metadata`` (a MetadataGroup or RemoteMetadata); closed by ``closers``.
    ``shared_dram``: its DRAM tier can be mapped by same-host peers (a node's; the embedded
    server, whose shards no other process reads, passes False)."""
    shard_dir = config.data_dir / "shards" / instance_id
    store = open_store(
        StoreConfig(
            data_dir=shard_dir,
            dram_capacity_bytes=config.dram_capacity_bytes,
            ssd_capacity_bytes=config.ssd_capacity_bytes,
            engine=engine_for(shard_dir, config.storage_engine),
            value_size=engine.page_nbytes,
            dram_shared=shared_dram,
            dram_prefault=config.dram_prefault,
            dram_write_ahead_bytes=config.dram_write_ahead_bytes,
            dram_write_behind=config.dram_write_behind,
        ),
        namespace_for(DEFAULT_TENANT, engine.model_fingerprint, kv_layout(engine)),
        node_id=NodeId(instance_id),
        metadata=metadata,  # type: ignore[arg-type]
    )
    closers.add(store.close)
    return store


def build_conductor(
    router_config: RouterConfig,
    model_dir: Path,
    model_fingerprint: str,
    index: PrefixIndex,
    link_bytes_per_s: float,
) -> Conductor:
    """The conductor over ``index`` with the time models measured for this model
    (``kvflow profile``), or the defaults with a warning that says how to measure them."""
    try:
        profile = load_profile(model_dir, model_id=model_fingerprint)
    except ProfileMismatchError as exc:
        logger.warning("%s; using the default time models", exc)
        profile = Profile.default()
    if profile.is_default:
        logger.warning(
            "no kvflow_profile.json in %s: the conductor uses default time models; "
            "run `kvflow profile --model %s` for fitted ones",
            model_dir,
            model_dir,
        )
    return Conductor(
        router_config,
        index,
        profile.prefill,
        profile.decode,
        TransferEstimator(link_bytes_per_s),
    )
