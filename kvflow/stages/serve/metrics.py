"""The serving metrics of kvflow (Prometheus): TTFT, TBT, cached tokens by tier, rejections."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvflow.kvdb import Shard
from kvflow.pipeline import Metrics

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TBT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServingMetrics:
    """Counters and histograms one embedded cluster records (thread-safe)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.ttft = metrics.histogram("ttft_seconds", "Time to first token", buckets=TTFT_BUCKETS_S)
        self.tbt = metrics.histogram("tbt_seconds", "Time between tokens", buckets=TBT_BUCKETS_S)
        self.requests = metrics.counter("requests", "Finished requests by outcome", ["outcome"])
        self.rejections = metrics.counter("rejections", "Requests rejected", ["reason"])
        self.prompt_tokens = metrics.counter("prompt_tokens", "Prompt tokens received")
        self.cached_tokens = metrics.counter(
            "cached_tokens", "Prompt tokens served from the store", ["tier"]
        )
        self.generated_tokens = metrics.counter("generated_tokens", "Tokens generated")
        self._tier_hits = metrics.gauge(
            "store_hit_rate", "Hits / lookups of each shard's tier", ["shard", "tier"]
        )

    def track_hit_rates(self, shards: Mapping[str, Callable[[], Mapping[str, float]]]) -> None:
        """Expose each shard's per-tier hit rate, read at scrape time."""
        for shard, rates in shards.items():
            for tier in ("dram", "ssd"):
                gauge = self._tier_hits.labels(shard=shard, tier=tier)
                gauge.set_function(lambda rates=rates, tier=tier: rates().get(tier, 0.0))


def shard_hit_rates(shard: Shard) -> Callable[[], dict[str, float]]:
    """A reader of ``shard``'s per-tier hit rates (for ``track_hit_rates``)."""

    def rates() -> dict[str, float]:
        s = shard.stats()
        return {"dram": s.dram.hit_rate, "ssd": s.ssd.hit_rate}

    return rates
