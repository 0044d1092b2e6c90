"""Pure records of the remote read path (reader side)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvflow.replication import Tier


class RemoteBlock(NamedTuple):
    """One leased block: ``length`` bytes at ``offset`` of the lease's segment, whose block
    checksum is ``checksum``; ``tier``: where the holder had it before the lease. ``seed``:
    ``codec.key_seed`` of the key the reader asked for and the parent and tenant the holder
    reported, so bytes of any other block, or a tenant that is not the one the checksum was
    made with, fail the check (0: unbound, the value alone). ``parent`` and
    ``tenant``: the block's parent key and owner tenant, as the holder reported them (what a
    copy of the block must keep). A NamedTuple: a lease of thousands of blocks builds one
    per block (a frozen dataclass cost ~3x as much to construct)."""

    offset: int
    length: int
    checksum: int
    tier: Tier
    seed: int = 0
    parent: bytes | None = None
    tenant: str = ""


@dataclass(frozen=True)
class RemoteLease:
    """A granted lease (``lease_id`` 0: nothing leased) over the leading keys asked for."""

    lease_id: int
    segment: str
    blocks: tuple[RemoteBlock, ...]
    timeout_s: float


@dataclass(frozen=True)
class RemoteStats:
    """Counters of a RemoteClient since it was created (a snapshot)."""

    leases: int
    hits: int
    misses: int
    transfer_failures: int
    checksum_failures: int
    bytes_read: int
    staged_bytes: int
    skipped: int = 0  # reads refused at once: the holder's circuit breaker was open
