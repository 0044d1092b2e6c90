"""What a corpus has in the cache: the coverage report of a job, and the dry-run estimate of
one not yet run. Both only read (match_prefix, the metadata's holders, the conductor's prefill
time model); both block, so call them in a worker thread."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.kvdb import block_keys
from kvflow.stages.warmup.corpus import CorpusItem
from kvflow.stages.warmup.job import JobOptions
from kvflow.stages.warmup.materialize import ItemError
from kvflow.stages.warmup.target import WarmTarget


@dataclass
class ItemCoverage:
    """One item: ``blocks_cached`` leading full blocks of ``blocks_total`` are held somewhere;
    ``tiers``: blocks by their fastest tier; ``holders``: every node holding one of them;
    ``min_replicas``/``max_replicas`` over the cached blocks; ``replica_target`` of the first."""

    index: int
    label: str
    tokens: int = 0
    blocks_total: int = 0
    blocks_cached: int = 0
    tiers: dict[str, int] = field(default_factory=dict)
    holders: list[str] = field(default_factory=list)
    min_replicas: int = 0
    max_replicas: int = 0
    replica_target: int = 0
    error: str = ""


@dataclass
class Totals:
    items: int = 0
    items_covered: int = 0  # every full block cached
    blocks_total: int = 0
    blocks_cached: int = 0
    bytes_cached: int = 0
    tokens_cached: int = 0
    prefill_s_saved: float = 0.0  # predicted by the conductor's prefill model
    prefill_s_cold: float = 0.0


_TIER_ORDER = {"dram": 0, "ssd": 1}


def _tier_name(tier: Any) -> str:
    return str(getattr(tier, "value", tier)).lower()


def coverage(
    items: list[CorpusItem], options: JobOptions, target: WarmTarget
) -> tuple[list[ItemCoverage], Totals]:
    ns = target.namespace(options.tenant)
    mat = target.materializer()
    rows: list[ItemCoverage] = []
    totals = Totals(items=len(items))
    for item in items:
        row = ItemCoverage(item.index, item.label or f"{item.source}:{item.line}")
        rows.append(row)
        try:
            tokens = mat.tokens(item)
        except ItemError as exc:
            row.error = str(exc)
            continue
        row.tokens = len(tokens)
        keys = block_keys(ns, tokens)
        row.blocks_total = len(keys)
        holders = target.holders(keys) if keys else []
        counts = []
        nodes: set[str] = set()
        for h in holders:
            if not h:
                break
            counts.append(len(h))
            nodes.update(h)
            best = min((_tier_name(t) for t in h.values()), key=lambda t: _TIER_ORDER.get(t, 9))
            row.tiers[best] = row.tiers.get(best, 0) + 1
        row.blocks_cached = len(counts)
        row.holders = sorted(nodes)
        row.min_replicas, row.max_replicas = min(counts, default=0), max(counts, default=0)
        row.replica_target = target.replica_target(keys[0]) if keys else 0
        cached_tokens = row.blocks_cached * target.block_size
        cold = target.predict_prefill_s(len(tokens), 0)
        totals.prefill_s_cold += cold
        totals.prefill_s_saved += cold - target.predict_prefill_s(len(tokens), cached_tokens)
        totals.items_covered += int(row.blocks_cached == row.blocks_total)
        totals.blocks_total += row.blocks_total
        totals.blocks_cached += row.blocks_cached
        totals.tokens_cached += cached_tokens
    totals.bytes_cached = totals.blocks_cached * target.block_nbytes
    return rows, totals


@dataclass
class Estimate:
    """A dry run: what the job would compute within its budget, and how long the conductor's
    model predicts it to take. Nothing is computed or stored."""

    items: int = 0
    items_ok: int = 0
    items_over_budget: int = 0
    item_errors: list[tuple[int, str]] = field(default_factory=list)
    blocks_total: int = 0
    blocks_cached: int = 0
    blocks_to_compute: int = 0
    bytes_to_compute: int = 0
    tokens_to_compute: int = 0
    predicted_prefill_s: float = 0.0
    budget_stops: bool = False


def estimate(items: list[CorpusItem], options: JobOptions, target: WarmTarget) -> Estimate:
    """The runner's decisions, replayed without computing (items sharing a prefix are counted
    once: keys already counted are treated as cached)."""
    ns = target.namespace(options.tenant)
    mat = target.materializer()
    limit = options.budget.limit_blocks(target.block_nbytes)
    est = Estimate(items=len(items))
    seen: set[bytes] = set()
    for item in items:
        try:
            tokens = mat.tokens(item)
        except ItemError as exc:
            est.item_errors.append((item.index, str(exc)))
            continue
        if len(tokens) + 1 > target.max_model_len:
            est.item_errors.append((item.index, f"{len(tokens)} tokens: over the maximum"))
            continue
        keys = block_keys(ns, tokens)
        cached = target.cached_blocks(keys)
        while cached < len(keys) and keys[cached] in seen:
            cached += 1
        need = len(keys) - cached
        est.blocks_total += len(keys)
        est.blocks_cached += cached
        if limit is not None and need > limit - est.blocks_to_compute:
            left = limit - est.blocks_to_compute
            if options.budget.on_limit == "skip":
                est.items_over_budget += 1
                continue
            if options.budget.on_limit == "stop" or left <= 0:
                est.budget_stops = True
                break
            need = left
        seen.update(keys[: cached + need])
        est.items_ok += 1
        est.blocks_to_compute += need
        est.tokens_to_compute += need * target.block_size
        est.predicted_prefill_s += target.predict_prefill_s(
            (cached + need) * target.block_size, cached * target.block_size
        )
    est.bytes_to_compute = est.blocks_to_compute * target.block_nbytes
    return est
