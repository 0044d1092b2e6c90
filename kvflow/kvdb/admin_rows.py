"""The KVAdmin reply rows built from a shard's statistics (protobuf messages). Pure."""

from __future__ import annotations

from typing import Any

from kvflow.kvdb.proto import pb2
from kvflow.kvdb.stats import StoreStats, TenantUsage, TierStats


def usage_row(t: TierStats) -> Any:
    """A TierUsage message of one tier's usage."""
    return pb2.TierUsage(blocks=t.blocks, used_bytes=t.used_bytes, capacity_bytes=t.capacity_bytes)


def shard_stats_row(shard: str, node: str, s: StoreStats) -> Any:
    """A ShardStats message of one shard's counters (both tiers added up)."""
    hits = s.dram.hits + s.ssd.hits
    misses = s.ssd.misses
    corrupt = s.dram.corruptions + s.ssd.corruptions
    return pb2.ShardStats(
        shard=shard,
        node=node,
        puts=s.puts,
        rejected_puts=s.rejected_puts,
        gets=hits + misses + corrupt,
        hits=hits,
        dram_hits=s.dram.hits,
        ssd_hits=s.ssd.hits,
        misses=misses,
        corruptions=corrupt,
        hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        bytes_read=s.dram.bytes_read + s.ssd.bytes_read,
        bytes_written=s.dram.bytes_written + s.ssd.bytes_written,
        events_dropped=s.events_dropped,
    )


def tenant_stats_row(shard: str, node: str, u: TenantUsage) -> Any:
    """A TenantStats message of what one tenant holds in one shard."""
    return pb2.TenantStats(
        shard=shard,
        node=node,
        tenant=u.tenant,
        blocks=u.blocks,
        dram_blocks=u.dram_blocks,
        ssd_blocks=u.ssd_blocks,
        bytes=u.nbytes,
        hits=u.hits,
    )
