"""What a simulation run measured, summarised."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RequestOutcome:
    """One simulated request. ``rejected`` is the reason value, or None when served."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prefill_id: str | None = None
    decode_id: str | None = None
    reused_tokens: int = 0
    pulled_blocks: int = 0
    predicted_ttft_s: float = 0.0
    ttft_s: float = 0.0
    tbt_s: float = 0.0
    finish_s: float = 0.0
    rejected: str | None = None


@dataclass(frozen=True)
class SimulationReport:
    """Aggregates over one run; times in seconds. TTFT/TBT statistics cover served requests."""

    policy: str
    num_requests: int
    served: int
    rejected: int
    rejection_rate: float
    rejected_by_reason: dict[str, int]
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_mean_s: float
    tbt_p99_s: float
    cache_hit_ratio: float
    pulls: int
    pulled_blocks: int
    evicted_blocks: int
    ttft_prediction_mae_s: float
    makespan_s: float
    requests_per_s: float
    per_instance_requests: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def summarise(
    policy: str, outcomes: Sequence[RequestOutcome], evicted_blocks: int
) -> SimulationReport:
    """Fold per-request outcomes into a report (pure)."""
    served = [o for o in outcomes if o.rejected is None]
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.rejected is not None:
            reasons[o.rejected] = reasons.get(o.rejected, 0) + 1
    ttft = np.array([o.ttft_s for o in served], dtype=float)
    tbt = np.array([o.tbt_s for o in served], dtype=float)
    error = np.array([abs(o.predicted_ttft_s - o.ttft_s) for o in served], dtype=float)
    prompt_tokens = sum(o.prompt_len for o in served)
    makespan = max((o.finish_s for o in served), default=0.0)
    per_instance: dict[str, int] = {}
    for o in served:
        assert o.prefill_id is not None
        per_instance[o.prefill_id] = per_instance.get(o.prefill_id, 0) + 1
    return SimulationReport(
        policy=policy,
        num_requests=len(outcomes),
        served=len(served),
        rejected=len(outcomes) - len(served),
        rejection_rate=(len(outcomes) - len(served)) / len(outcomes) if outcomes else 0.0,
        rejected_by_reason=reasons,
        ttft_mean_s=float(ttft.mean()) if ttft.size else 0.0,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p90_s=_pct(ttft, 90),
        ttft_p99_s=_pct(ttft, 99),
        tbt_mean_s=float(tbt.mean()) if tbt.size else 0.0,
        tbt_p99_s=_pct(tbt, 99),
        cache_hit_ratio=sum(o.reused_tokens for o in served) / prompt_tokens
        if prompt_tokens
        else 0.0,
        pulls=sum(1 for o in served if o.pulled_blocks),
        pulled_blocks=sum(o.pulled_blocks for o in served),
        evicted_blocks=evicted_blocks,
        ttft_prediction_mae_s=float(error.mean()) if error.size else 0.0,
        makespan_s=makespan,
        requests_per_s=len(served) / makespan if makespan > 0 else 0.0,
        per_instance_requests=dict(sorted(per_instance.items())),
    )
