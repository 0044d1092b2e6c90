"""DRAM leases and hit ranking: the shard-side half of the remote read path and of "hot".

A remote reader cannot take the shard's lock while it copies, so the holder *leases* blocks:
it makes sure each is in DRAM (promoting an SSD hit in place), pins it (a pinned block is never
evicted, so its extent stays put) and hands out (offset, length, checksum). The reader copies
the bytes out of the DRAM pool with the transfer engine and verifies the checksum itself; the
holder drops the pins when the lease is released.

Every function here must be called with the shard's lock held; they mutate the shard's index,
tiers, counters and outbox through ``ShardState`` / ``TierMover``.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from typing import NamedTuple

from kvflow.kvdb.entry import Entry
from kvflow.kvdb.errors import ChecksumError
from kvflow.kvdb.events import BlockStored
from kvflow.kvdb.keys import BlockKey
from kvflow.kvdb.mover import ShardState, TierMover
from kvflow.replication import Tier

logger = logging.getLogger(__name__)


class LeasedBlock(NamedTuple):
    """One leased block: its bytes are ``pool[offset : offset + nbytes]`` of the holder's DRAM
    pool while the lease holds; ``checksum`` is the block checksum of those bytes (value, key,
    ``parent`` and ``tenant``: ``codec.block_checksum``); ``tier`` is where the block was
    before the lease (SSD: it was promoted into DRAM for the lease)."""

    key: BlockKey
    offset: int
    nbytes: int
    checksum: int
    tier: Tier
    parent: BlockKey | None = None
    tenant: str = ""


class HotBlock(NamedTuple):
    """A block and the reads it has served since it was stored (or re-adopted)."""

    key: BlockKey
    hits: int
    tier: Tier
    nbytes: int
    pins: int
    tenant: str = ""


def lease_leading(
    state: ShardState, mover: TierMover, keys: Sequence[BlockKey], promote: bool, now: int
) -> list[LeasedBlock]:
    """Pin the leading ``keys`` that are (or can be brought) in DRAM, stopping at the first
    that is absent, cannot be brought into DRAM, or fails its SSD checksum. Each leased block
    counts as a hit of the tier it was in and is one pin until released."""
    out: list[LeasedBlock] = []
    for key in keys:
        e = state.index.get(key)
        if e is None:
            state.dram_counters.misses += 1
            state.ssd_counters.misses += 1
            break
        tier = e.tier
        e.pins += 1  # first: reserving DRAM below must not evict this block from SSD
        if e.dram is None and not (promote and _promote_in_place(state, mover, e)):
            e.pins -= 1
            if state.index.get(key) is e:
                state.dram_counters.misses += 1
            break
        assert e.dram is not None
        e.last_access = now
        e.hits += 1
        counters = state.dram_counters if tier is Tier.DRAM else state.ssd_counters
        counters.hits += 1
        counters.bytes_read += e.nbytes
        out.append(LeasedBlock(e.key, e.dram, e.nbytes, e.checksum, tier, e.parent, e.tenant))
    return out


def _promote_in_place(state: ShardState, mover: TierMover, e: Entry) -> bool:
    """Read ``e``'s SSD record straight into a fresh DRAM extent (verified on the way). False
    if there is no DRAM room or the record is gone or corrupt (then it is discarded)."""
    dram, ssd = state.dram, state.ssd
    if dram is None or ssd is None or not e.on_ssd:
        return False
    offset = mover.reserve_dram(e.nbytes, frozenset((e.key,)))
    if offset is None:
        return False
    try:
        ok = ssd.read_into(e.key, dram.view(offset, e.nbytes))
    except ChecksumError as exc:
        logger.warning("lease: ssd record corrupt key=%s: %s", e.key.hex(), exc)
        ok = False
    if not ok:
        dram.free(offset, e.nbytes)
        state.ssd_counters.corruptions += 1
        pins, e.pins = e.pins, 0
        mover.discard_corrupt(e, Tier.SSD)
        e.pins = pins
        return False
    e.dram = offset
    state.ssd_counters.promotions += 1
    state.emit(BlockStored(e.key, Tier.DRAM, e.nbytes, e.parent))
    return True


def release_pins(state: ShardState, keys: Sequence[BlockKey]) -> int:
    """Drop one pin from each key that is still held with a pin (a key removed meanwhile, e.g.
    as corrupt, is skipped). Returns the pins dropped."""
    dropped = 0
    for key in keys:
        e = state.index.get(key)
        if e is not None and e.pins > 0:
            e.pins -= 1
            dropped += 1
    return dropped


def hottest(state: ShardState, n: int, tenant: str | None = None) -> list[HotBlock]:
    """The ``n`` blocks with the most hits (ties: most recently used first), of every tenant
    or only of ``tenant``; blocks never read are left out."""
    top = heapq.nlargest(
        n,
        (e for e in state.index.values() if e.hits > 0 and (tenant is None or e.tenant == tenant)),
        key=lambda e: (e.hits, e.last_access),
    )
    return [HotBlock(e.key, e.hits, e.tier, e.nbytes, e.pins, e.tenant) for e in top]
