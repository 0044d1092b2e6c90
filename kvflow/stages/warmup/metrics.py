"""Prometheus metrics of warm-up jobs (in the process's own registry)."""

from __future__ import annotations

from typing import Any

from kvflow.stages.warmup.job import ItemResult, ItemState


class WarmupMetrics:
    """Counters a runner adds to as items finish; ``jobs`` is a gauge per job state."""

    def __init__(self, metrics: Any) -> None:
        self.items = metrics.counter(
            "warmup_items", "Warm-up corpus items finished, by outcome", ["state"]
        )
        self.blocks = metrics.counter("warmup_blocks", "Blocks computed into the cache by warm-up")
        self.bytes = metrics.counter("warmup_bytes", "Bytes of blocks computed by warm-up")
        self.errors = metrics.counter(
            "warmup_errors", "Warm-up items and corpus lines that failed", ["kind"]
        )
        self.jobs = metrics.gauge("warmup_jobs", "Warm-up jobs by state", ["state"])

    def item(self, result: ItemResult, block_nbytes: int) -> None:
        self.items.labels(state=result.state.value).inc()
        self.blocks.inc(result.blocks_warmed)
        self.bytes.inc(result.blocks_warmed * block_nbytes)
        if result.state is ItemState.ERROR:
            self.errors.labels(kind="item").inc()

    def corpus_errors(self, n: int) -> None:
        if n:
            self.errors.labels(kind="corpus_line").inc(n)
