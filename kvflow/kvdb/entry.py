"""Entry: the shard's record of one block it holds (mutable; guarded by the shard's lock)."""

from __future__ import annotations

import sys
from typing import NamedTuple

from kvflow.kvdb.keys import BlockKey
from kvflow.replication import Tier


class Entry:
    """One block: where it lives (a DRAM extent and/or an SSD record), its raw size and
    checksum, its parent (for prefix-aware eviction), its owner ``tenant`` (the namespace it
    was put under: admin views filter on it; an interned string, so entries share it), pins
    and in-flight readers.

    A block may be in both tiers at once (a promoted block keeps its SSD record, so demoting
    it again costs no write); its tier is the fastest one.
    """

    __slots__ = (
        "checksum",
        "doomed",
        "dram",
        "hits",
        "key",
        "last_access",
        "nbytes",
        "on_ssd",
        "parent",
        "pins",
        "readers",
        "tenant",
    )

    def __init__(
        self,
        key: BlockKey,
        nbytes: int,
        checksum: int,
        parent: BlockKey | None,
        now: int,
        tenant: str,
    ) -> None:
        self.key = key
        self.tenant = sys.intern(tenant)
        self.nbytes = nbytes
        self.checksum = checksum
        self.parent = parent
        self.dram: int | None = None
        self.on_ssd = False
        self.pins = 0
        self.readers = 0
        self.doomed = False  # removed from the index while being read; freed by the last reader
        self.last_access = now
        self.hits = 0  # reads served (local get_into and remote leases), for the admin's "hot"

    @property
    def tier(self) -> Tier:
        return Tier.DRAM if self.dram is not None else Tier.SSD

    @property
    def evictable(self) -> bool:
        return self.pins == 0 and self.readers == 0


class BlockInfo(NamedTuple):
    """A snapshot of one held block, for callers outside the shard: what a copy of it needs
    besides its bytes (its parent and owner tenant), and where it is."""

    key: BlockKey
    tier: Tier
    nbytes: int
    parent: BlockKey | None
    tenant: str
