"""Configuration and cost model of the offline trace simulator."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvflow.router.config import RouterConfig
from kvflow.router.estimators import DecodeTimeModel, PrefillTimeModel
from kvflow.router.trace import TRACE_BLOCK_SIZE

# LLaMA3-70B (80 layers, 8 KV heads, head dim 128, fp16): 2 * 80 * 8 * 128 * 2 bytes per token.
REFERENCE_KV_BYTES_PER_TOKEN = 327_680


def reference_prefill_model() -> PrefillTimeModel:
    """A LLaMA3-70B-like prefill on one 8-GPU node (~9k new tokens/s at 50% MFU; attention ~1 ns
    per (query, key) pair-unit; reused tokens loaded at ~50 GB/s). Derived, not measured."""
    return PrefillTimeModel((0.03, 1.1e-4, 1.05e-9, 6.5e-6), "reference-70b")


def reference_decode_model() -> DecodeTimeModel:
    """A LLaMA3-70B-like decode node: 25 ms per step, +0.3 ms per sequence, KV reads ~40 ns per
    context token. Derived, not measured."""
    return DecodeTimeModel((0.025, 3e-4, 4e-8), "reference-70b")


def _reference_router() -> RouterConfig:
    return RouterConfig(
        block_size=TRACE_BLOCK_SIZE, block_nbytes=TRACE_BLOCK_SIZE * REFERENCE_KV_BYTES_PER_TOKEN
    )


@dataclass(frozen=True)
class SimulationConfig:
    """A simulated cluster. ValueError names the offending field.

    Fields:
        num_prefill, num_decode: instance counts (>= 1).
        cache_capacity_blocks: per prefill instance LRU prefix cache size in blocks (None = no
            limit).
        bandwidth_bytes_per_s, transfer_latency_s: the true link of each holder; a holder's
            outbound link serves one pull at a time (so a hot holder congests).
        time_scale: multiplies trace inter-arrival times (< 1 compresses the trace = more load).
        prefill_model, decode_model: the *true* costs the simulated engines take; the conductor
            predicts with the same models (perfect estimators) unless ``predict_*`` are given.
        router: the conductor's configuration (policy, SLOs, threshold, block size and bytes, seed).
    """

    num_prefill: int = 4
    num_decode: int = 4
    cache_capacity_blocks: int | None = 10_000
    bandwidth_bytes_per_s: float = 25e9
    transfer_latency_s: float = 1e-3
    time_scale: float = 1.0
    prefill_model: PrefillTimeModel = field(default_factory=reference_prefill_model)
    decode_model: DecodeTimeModel = field(default_factory=reference_decode_model)
    predict_prefill_model: PrefillTimeModel | None = None
    predict_decode_model: DecodeTimeModel | None = None
    router: RouterConfig = field(default_factory=_reference_router)

    def __post_init__(self) -> None:
        if self.num_prefill < 1:
            raise ValueError(f"num_prefill must be >= 1, got {self.num_prefill}")
        if self.num_decode < 1:
            raise ValueError(f"num_decode must be >= 1, got {self.num_decode}")
        if self.cache_capacity_blocks is not None and self.cache_capacity_blocks < 1:
            raise ValueError(
                f"cache_capacity_blocks must be >= 1 or None, got {self.cache_capacity_blocks}"
            )
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        if not (math.isfinite(self.transfer_latency_s) and self.transfer_latency_s >= 0):
            raise ValueError(f"transfer_latency_s must be >= 0, got {self.transfer_latency_s}")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
