"""Configuration and cost model of the offline trace simulator.

Units: tokens for lengths, blocks (of ``router.block_size`` tokens) for prefix-cache capacity,
tokens for decode KV memory, bytes/s for link bandwidth, seconds for every time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvflow.router.config import RouterConfig
from kvflow.router.estimators import DecodeTimeModel, PrefillTimeModel
from kvflow.router.sim_presets import CostPreset, llama3_70b_8xa100
from kvflow.router.trace import TRACE_BLOCK_SIZE

# LLaMA3-70B (80 layers, 8 KV heads, head dim 128, fp16): 2 * 80 * 8 * 128 * 2 bytes per token.
REFERENCE_KV_BYTES_PER_TOKEN = 327_680


def reference_prefill_model() -> PrefillTimeModel:
    """The default preset's prefill (LLaMA3-70B on 8 A100s; derived, see sim_presets)."""
    return llama3_70b_8xa100().prefill


def reference_decode_model() -> DecodeTimeModel:
    """The default preset's decode (LLaMA3-70B on 8 A100s; derived, see sim_presets)."""
    return llama3_70b_8xa100().decode


def _reference_router() -> RouterConfig:
    return RouterConfig(
        block_size=TRACE_BLOCK_SIZE, block_nbytes=TRACE_BLOCK_SIZE * REFERENCE_KV_BYTES_PER_TOKEN
    )


@dataclass(frozen=True)
class SimulationConfig:
    """A simulated cluster. ValueError names the offending field.

    Fields:
        num_prefill, num_decode: instance counts (>= 1).
        cache_capacity_blocks: per prefill instance LRU prefix cache, in *blocks* of
            ``router.block_size`` tokens (None = unbounded).
        bandwidth_bytes_per_s, transfer_latency_s: each holder's outbound link; it serves one
            pull at a time (so a hot holder congests).
        time_scale: multiplies trace inter-arrival times (< 1 compresses the trace = more load).
        prefill_model, decode_model: the *true* costs the simulated engines take; the conductor
            predicts with the same models (perfect estimators) unless ``predict_*`` are given.
        decode_capacity_tokens: KV memory of one decode instance in tokens (None = unbounded);
            a request needs ``prompt + output`` tokens of it for its whole decode.
        prefill_chunk_tokens: most new tokens one request computes per prefill step.
        prefill_batch_tokens: most new tokens one prefill step computes over all its requests.
        ttft_slo_s, tbt_slo_s: the SLOs the *metrics* judge (effective capacity, goodput);
            None uses the router's (None there too: that SLO is not judged).
        router: the conductor's configuration (policy, admission SLOs, threshold, block size and
            bytes, seed).
        cost_source: where the cost model comes from (reported with the results).
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
    decode_capacity_tokens: int | None = None
    prefill_chunk_tokens: int = 1 << 30
    prefill_batch_tokens: int = 1 << 30
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    router: RouterConfig = field(default_factory=_reference_router)
    cost_source: str = "llama3-70b-8xa100 (derived, not measured)"

    def __post_init__(self) -> None:
        if self.num_prefill < 1:
            raise ValueError(f"num_prefill must be >= 1, got {self.num_prefill}")
        if self.num_decode < 1:
            raise ValueError(f"num_decode must be >= 1, got {self.num_decode}")
        for name in ("cache_capacity_blocks", "decode_capacity_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        for name in ("prefill_chunk_tokens", "prefill_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        if not (math.isfinite(self.transfer_latency_s) and self.transfer_latency_s >= 0):
            raise ValueError(f"transfer_latency_s must be >= 0, got {self.transfer_latency_s}")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        for name in ("ttft_slo_s", "tbt_slo_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be None or > 0, got {value!r}")

    @property
    def judged_ttft_slo_s(self) -> float | None:
        return self.ttft_slo_s if self.ttft_slo_s is not None else self.router.ttft_slo_s

    @property
    def judged_tbt_slo_s(self) -> float | None:
        return self.tbt_slo_s if self.tbt_slo_s is not None else self.router.tbt_slo_s

    @classmethod
    def from_preset(
        cls, preset: CostPreset, block_size: int = TRACE_BLOCK_SIZE, **fields: object
    ) -> SimulationConfig:
        """A config running ``preset``'s models with blocks of ``block_size`` tokens; ``fields``
        override anything else (``router`` is rebuilt from the block size unless given)."""
        router = RouterConfig(
            block_size=block_size, block_nbytes=block_size * preset.kv_bytes_per_token
        )
        merged: dict[str, object] = {
            "prefill_model": preset.prefill,
            "decode_model": preset.decode,
            "decode_capacity_tokens": preset.decode_capacity_tokens,
            "router": router,
            "cost_source": f"{preset.name}: {preset.source}",
        }
        merged.update(fields)
        return cls(**merged)  # type: ignore[arg-type]
