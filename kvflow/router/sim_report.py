"""What a simulation run measured, summarised: the paper's metrics.

- **Effective request capacity** (§8): the share of *all* requests served within both SLOs
  (TTFT and TBT; a rejected request is not within them). **Goodput**: requests (and output
  tokens) within both SLOs per second of trace time.
- Hit ratio split: ``local_hit_ratio`` (prompt tokens reused from the chosen instance's own cache)
  and ``pulled_hit_ratio`` (reused after pulling the blocks from another instance); their sum is
  ``cache_hit_ratio``. All over served requests' prompt tokens.
- TTFT / TBT percentiles over served requests; TBT of a request = (finish - first token) /
  output tokens, so it includes any wait for decode memory.
- Rejections by reason; per-instance requests, busy seconds and (decode) peak KV tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvflow.router.sim_config import SimulationConfig


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
    local_hit_tokens: int = 0
    pulled_blocks: int = 0
    predicted_ttft_s: float = 0.0
    ttft_s: float = 0.0
    prefill_done_s: float = 0.0
    decode_wait_s: float = 0.0
    tbt_s: float = 0.0
    finish_s: float = 0.0
    rejected: str | None = None

    def within(self, ttft_slo_s: float | None, tbt_slo_s: float | None) -> bool:
        """Served within both SLOs (None: that SLO is not judged)."""
        if self.rejected is not None:
            return False
        if ttft_slo_s is not None and self.ttft_s > ttft_slo_s:
            return False
        return tbt_slo_s is None or self.tbt_s <= tbt_slo_s


@dataclass(frozen=True)
class InstanceLoad:
    """One instance over the run: requests it finished, seconds it computed, peak KV tokens
    (decode instances; 0 for prefill)."""

    instance_id: str
    kind: str
    requests: int
    busy_s: float
    peak_kv_tokens: int


@dataclass(frozen=True)
class SimulationReport:
    """Aggregates over one run; times in seconds. TTFT/TBT statistics cover served requests."""

    policy: str
    num_requests: int
    served: int
    rejected: int
    rejection_rate: float
    rejected_by_reason: dict[str, int]
    ttft_slo_s: float | None
    tbt_slo_s: float | None
    within_slo: int
    effective_capacity: float
    goodput_rps: float
    goodput_tokens_per_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_mean_s: float
    tbt_p50_s: float
    tbt_p90_s: float
    tbt_p99_s: float
    cache_hit_ratio: float
    local_hit_ratio: float
    pulled_hit_ratio: float
    pulls: int
    pulled_blocks: int
    evicted_blocks: int
    ttft_prediction_mae_s: float
    duration_s: float
    makespan_s: float
    requests_per_s: float
    cost_source: str
    per_instance_requests: dict[str, int] = field(default_factory=dict)
    instances: tuple[InstanceLoad, ...] = ()
    outcomes: tuple[RequestOutcome, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Every aggregate (the per-request ``outcomes`` are left out: see the CSV export)."""
        doc = asdict(replace(self, outcomes=()))
        del doc["outcomes"]
        return doc


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def summarise(
    config: SimulationConfig,
    policy: str,
    outcomes: Sequence[RequestOutcome],
    evicted_blocks: int,
    loads: Sequence[InstanceLoad],
    duration_s: float,
) -> SimulationReport:
    """Fold per-request outcomes into a report (pure)."""
    served = [o for o in outcomes if o.rejected is None]
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.rejected is not None:
            reasons[o.rejected] = reasons.get(o.rejected, 0) + 1
    ttft_slo, tbt_slo = config.judged_ttft_slo_s, config.judged_tbt_slo_s
    good = [o for o in served if o.within(ttft_slo, tbt_slo)]
    ttft = np.array([o.ttft_s for o in served], dtype=float)
    tbt = np.array([o.tbt_s for o in served], dtype=float)
    error = np.array([abs(o.predicted_ttft_s - o.ttft_s) for o in served], dtype=float)
    prompt_tokens = sum(o.prompt_len for o in served)
    reused = sum(o.reused_tokens for o in served)
    local = sum(o.local_hit_tokens for o in served)
    makespan = max((o.finish_s for o in served), default=0.0)
    span = max(duration_s, 1e-9)
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
        ttft_slo_s=ttft_slo,
        tbt_slo_s=tbt_slo,
        within_slo=len(good),
        effective_capacity=len(good) / len(outcomes) if outcomes else 0.0,
        goodput_rps=len(good) / span if outcomes else 0.0,
        goodput_tokens_per_s=sum(o.output_len for o in good) / span if outcomes else 0.0,
        ttft_mean_s=float(ttft.mean()) if ttft.size else 0.0,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p90_s=_pct(ttft, 90),
        ttft_p99_s=_pct(ttft, 99),
        tbt_mean_s=float(tbt.mean()) if tbt.size else 0.0,
        tbt_p50_s=_pct(tbt, 50),
        tbt_p90_s=_pct(tbt, 90),
        tbt_p99_s=_pct(tbt, 99),
        cache_hit_ratio=reused / prompt_tokens if prompt_tokens else 0.0,
        local_hit_ratio=local / prompt_tokens if prompt_tokens else 0.0,
        pulled_hit_ratio=(reused - local) / prompt_tokens if prompt_tokens else 0.0,
        pulls=sum(1 for o in served if o.pulled_blocks),
        pulled_blocks=sum(o.pulled_blocks for o in served),
        evicted_blocks=evicted_blocks,
        ttft_prediction_mae_s=float(error.mean()) if error.size else 0.0,
        duration_s=duration_s,
        makespan_s=makespan,
        requests_per_s=len(served) / makespan if makespan > 0 else 0.0,
        cost_source=config.cost_source,
        per_instance_requests=dict(sorted(per_instance.items())),
        instances=tuple(loads),
        outcomes=tuple(outcomes),
    )
