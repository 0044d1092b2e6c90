"""Per-tier statistics: mutable counters inside the shard, frozen snapshots outside."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.kvdb.dram import DramTier
    from kvflow.kvdb.entry import Entry
    from kvflow.kvdb.ssd import SsdTier


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier. Counters count since the shard opened (or the last reset);
    ``blocks``/``used_bytes``/``capacity_bytes`` are the current state.

    hits/misses: lookups this tier served / could not serve (a miss in DRAM that SSD serves is
    one DRAM miss and one SSD hit). evictions: blocks dropped from this tier. demotions: DRAM
    blocks moved down to SSD (counted on DRAM). promotions: SSD hits copied up to DRAM (counted
    on SSD). corruptions: records that failed their checksum (removed, never returned).
    """

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    corruptions: int = 0
    blocks: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a shard: one TierStats per tier plus put outcomes."""

    dram: TierStats
    ssd: TierStats
    puts: int = 0
    rejected_puts: int = 0
    events_dropped: int = 0


@dataclass(frozen=True)
class TenantUsage:
    """What one tenant holds in a shard now (computed from the index on the call, the same
    scan a StoreStats snapshot makes): blocks in DRAM and on SSD (a promoted block counts in
    both), their raw bytes (each block once), and the reads its blocks served (each block's
    hit count since it was stored or re-adopted: blocks evicted since take theirs along).
    Shard-wide counters (puts, misses, bytes read/written) have no owner and are not here."""

    tenant: str
    blocks: int = 0
    dram_blocks: int = 0
    ssd_blocks: int = 0
    nbytes: int = 0
    hits: int = 0


def tenant_usage(entries: Iterable[Entry], tenant: str) -> TenantUsage:
    """A TenantUsage of ``tenant`` over a shard's entries (caller holds the shard lock)."""
    blocks = dram = ssd = nbytes = hits = 0
    for e in entries:
        if e.tenant != tenant:
            continue
        blocks += 1
        dram += e.dram is not None
        ssd += e.on_ssd
        nbytes += e.nbytes
        hits += e.hits
    return TenantUsage(tenant, blocks, dram, ssd, nbytes, hits)


_COUNTERS = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "evictions",
    "demotions",
    "promotions",
    "corruptions",
)


class TierCounters:
    """Mutable counters of one tier; the shard updates them under its lock."""

    __slots__ = _COUNTERS

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        for name in _COUNTERS:
            setattr(self, name, 0)

    def snapshot(self, blocks: int, used_bytes: int, capacity_bytes: int) -> TierStats:
        values = {f.name: getattr(self, f.name) for f in fields(TierStats) if f.name in _COUNTERS}
        return TierStats(
            **values, blocks=blocks, used_bytes=used_bytes, capacity_bytes=capacity_bytes
        )


def snapshot(
    entries: Iterable[Entry],
    dram: DramTier | None,
    ssd: SsdTier | None,
    dram_counters: TierCounters,
    ssd_counters: TierCounters,
    *,
    puts: int,
    rejected: int,
    dropped: int,
) -> StoreStats:
    """A StoreStats of a shard's current state (caller holds the shard lock)."""
    dram_blocks = sum(1 for e in entries if e.dram is not None)
    return StoreStats(
        dram=dram_counters.snapshot(
            dram_blocks, dram.used if dram else 0, dram.capacity if dram else 0
        ),
        ssd=ssd_counters.snapshot(
            len(ssd.sizes) if ssd else 0, ssd.used if ssd else 0, ssd.capacity if ssd else 0
        ),
        puts=puts,
        rejected_puts=rejected,
        events_dropped=dropped,
    )
