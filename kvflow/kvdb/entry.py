"""Entry: the shard's record of one block it holds (mutable; guarded by the shard's lock)."""

from __future__ import annotations

from kvflow.kvdb.keys import BlockKey
from kvflow.replication import Tier


class Entry:
    """One block: where it lives (a DRAM extent and/or an SSD record), its raw size and
    checksum, its parent (for prefix-aware eviction), pins and in-flight readers.

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
    )

    def __init__(
        self, key: BlockKey, nbytes: int, checksum: int, parent: BlockKey | None, now: int
    ) -> None:
        self.key = key
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
