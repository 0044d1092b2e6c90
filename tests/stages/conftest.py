"""A stage rig, mini-sglang style: the stages with a small real engine (EngineWorker thread),
kvdb shards in memory, and the transfer engine in this process; no gRPC, no pipeline.

``Rig.run(stage, ctx)`` runs one stage's ``run`` the way the pipeline does (inside the
context's stage frame is not needed: spans open as top-level spans)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow.pipeline import RequestContext
from kvflow.router import (
    Conductor,
    DecodeTimeModel,
    InstanceState,
    PrefillTimeModel,
    RouterConfig,
    TransferEstimator,
)
from kvflow.stages.engine import SamplingParams
from kvflow.stages.hash import namespace_for
from kvflow.stages.runtime.instances import DecodeInstance, PrefillInstance, pool_segment_name
from kvflow.stages.runtime.prefix_index import ShardPrefixIndex
from kvflow.stages.runtime.staging import StagingArea
from kvflow.stages.serve.build import kv_layout, open_engine, open_shard
from kvflow.stages.serve.closers import Closers
from kvflow.stages.serve.config import EngineStoreConfig
from kvflow.stages.state import GenerateState
from kvflow.transfer import TransferConfig, TransferEngine

BLOCK = 16


class Rig:
    """``prefill`` and ``decode`` instances (ids prefill-0.., decode-0) of one model."""

    def __init__(self, model: Path, data_dir: Path, num_prefill: int = 2) -> None:
        self.closers = Closers()
        self.config = EngineStoreConfig(
            model_dir=model,
            data_dir=data_dir,
            block_size=BLOCK,
            num_pages=128,
            prefill_chunk=32,
            staging_pages=64,
            dram_capacity_bytes=64 << 20,
            storage_engine="memory",
        )
        self.transfer = TransferEngine(TransferConfig())
        self.closers.add(self.transfer.close)
        self.prefill: dict[str, PrefillInstance] = {}
        self.pools: dict[str, torch.Tensor] = {}
        for i in range(num_prefill):
            self._add_prefill(f"prefill-{i}")
        worker = open_engine(model, self.config, "decode-0", self.closers)
        e = worker.engine
        store = open_shard(self.config, "decode-0", e, None, self.closers)
        staging = StagingArea("decode-0", 64, e.page_shape, e.page_dtype, self.transfer)
        self.decode = {
            "decode-0": DecodeInstance(
                "decode-0", worker, InstanceState("decode-0", "decode"), staging, store
            )
        }
        self.engine = worker.engine
        self.layout = kv_layout(self.engine)

    def _add_prefill(self, iid: str) -> None:
        worker = open_engine(self.config.model_dir, self.config, iid, self.closers)  # type: ignore[arg-type]
        e = worker.engine
        store = open_shard(self.config, iid, e, None, self.closers)
        pool = e.host_pool.view(torch.uint8).numpy()
        self.transfer.register_memory(pool_segment_name(iid), pool)
        self.pools[iid] = e.host_pool
        load = StagingArea(iid, 64, e.page_shape, e.page_dtype, None, name=f"{iid}/load")
        self.prefill[iid] = PrefillInstance(iid, worker, store, InstanceState(iid, "prefill"), load)

    def conductor(self, policy: str = "cache-aware", **kw: Any) -> Conductor:
        return Conductor(
            RouterConfig(
                policy=policy, block_size=BLOCK, block_nbytes=self.engine.page_nbytes, **kw
            ),
            ShardPrefixIndex(self.prefill),
            PrefillTimeModel.default(),
            DecodeTimeModel.default(),
            TransferEstimator(4e9),
        )

    def state(self, ids: list[int], max_tokens: int = 8) -> GenerateState:
        from kvflow.kvdb import block_keys

        s = GenerateState(
            tenant="default",
            max_tokens=max_tokens,
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            prompt_ids=list(ids),
        )
        s.namespace = namespace_for("", self.engine.model_fingerprint, self.layout)
        s.block_keys = block_keys(s.namespace, s.prompt_ids)
        return s

    def close(self) -> None:
        self.closers.close_all()


def context(request_id: str, state: GenerateState) -> RequestContext[GenerateState]:
    state.booking.request_id = request_id
    return RequestContext(request_id, state=state)


def fresh(state: GenerateState) -> GenerateState:
    return dataclasses.replace(state)


@pytest.fixture
def rig(tiny_model: Path, tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tiny_model, tmp_path)
    yield r
    r.close()
