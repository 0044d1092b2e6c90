"""TierMover: the mechanism that moves blocks between tiers — eviction, demotion, promotion.

It applies an EvictionPolicy (which only ranks) to the shard's entries. Every method must be
called with the shard's lock held; it mutates the shard's index, tiers, counters and outbox.
Engine I/O (demotion writes, SSD deletes) happens under that lock.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvflow.kvdb.codec import block_checksum
from kvflow.kvdb.dram import DramTier
from kvflow.kvdb.entry import Entry
from kvflow.kvdb.events import BlockEvent, BlockRemoved, BlockStored
from kvflow.kvdb.eviction import Candidate, EvictAction, EvictionPolicy, TierBlock, select_victims
from kvflow.kvdb.keys import BlockKey
from kvflow.kvdb.replicas import ReplicaCounter
from kvflow.kvdb.ssd import SsdTier
from kvflow.kvdb.stats import TierCounters
from kvflow.replication import Tier

logger = logging.getLogger(__name__)

_FLUSH_CHUNK_BYTES = 64 * 1024 * 1024


@dataclass
class ShardState:
    """The parts of a shard the mover works on (shared by reference with the shard)."""

    index: dict[BlockKey, Entry]
    dram: DramTier | None
    ssd: SsdTier | None
    dram_counters: TierCounters
    ssd_counters: TierCounters
    emit: Callable[[BlockEvent], None]
    # Pins still owed on blocks removed while pinned (a corrupt copy was their last): the
    # holders' unpin consumes these first, so a pin on a lost block is never a NotPinnedError
    # nor a leak. Keyed by key: a block stored again under the key shares the count.
    lost_pins: dict[BlockKey, int] = field(default_factory=dict)


class TierMover:
    """Eviction, demotion and promotion over a ShardState (caller holds the shard lock)."""

    def __init__(
        self,
        state: ShardState,
        policy: EvictionPolicy,
        replicas: ReplicaCounter,
        high_watermark: float,
        low_watermark: float,
    ) -> None:
        self.s = state
        self.policy = policy
        self.replicas = replicas
        self.high = high_watermark
        self.low = low_watermark
        self._behind: deque[BlockKey] = deque()  # write_behind's plan, next first

    # ----------------------------------------------------------------- candidates

    def tier_blocks(
        self, tier: Tier, protect: frozenset[bytes] = frozenset()
    ) -> dict[BlockKey, TierBlock]:
        """Every block in ``tier`` as the victim selector sees it. A child blocks its parent
        when it is in the same tier (DRAM) or in any tier (SSD: dropping the parent there
        would make the child unreachable)."""
        s = self.s
        if tier is Tier.DRAM:
            members = [e for e in s.index.values() if e.dram is not None]
        else:
            members = [e for e in s.index.values() if e.on_ssd]
        member_keys = {e.key for e in members}
        blocking: Counter[bytes] = Counter()
        for e in s.index.values():
            if e.parent is not None and e.parent in member_keys:
                if tier is Tier.DRAM and e.dram is None:
                    continue
                blocking[e.parent] += 1
        counts = self.replicas.replica_counts([e.key for e in members])
        sizes = s.ssd.sizes if (tier is Tier.SSD and s.ssd is not None) else None
        return {
            e.key: TierBlock(
                candidate=Candidate(
                    key=e.key,
                    last_access=e.last_access,
                    replicas=count,
                    nbytes=e.nbytes if sizes is None else sizes[e.key],
                ),
                parent=e.parent,
                evictable=e.evictable and e.key not in protect,
                blocking_children=blocking[e.key],
            )
            for e, count in zip(members, counts, strict=True)
        }

    # ----------------------------------------------------------------- DRAM

    def reserve_dram(self, nbytes: int, protect: frozenset[bytes] = frozenset()) -> int | None:
        """An extent for ``nbytes``, evicting down to the low watermark when the high one would
        be crossed. None if DRAM cannot make room. StoreFullError from a demotion propagates
        (the victims then stay in DRAM)."""
        dram = self.s.dram
        if dram is None or dram.rounded(nbytes) > dram.capacity:
            return None
        need = dram.rounded(nbytes)
        if dram.used + need > dram.capacity * self.high:
            self.evict_dram(int(dram.used + need - dram.capacity * self.low), protect)
        for _ in range(8):
            offset = dram.allocate(nbytes)
            if offset is not None:
                return offset
            if not self.evict_dram(need, protect):
                break
        return None

    def drop_dram_copy(self, e: Entry) -> None:
        assert self.s.dram is not None and e.dram is not None
        self.s.dram.free(e.dram, e.nbytes)
        e.dram = None

    def evict_dram(self, need_bytes: int, protect: frozenset[bytes] = frozenset()) -> int:
        """Evict DRAM blocks freeing >= ``need_bytes`` if possible; returns blocks evicted."""
        s = self.s
        assert s.dram is not None
        blocks = self.tier_blocks(Tier.DRAM, protect)
        victims = select_victims(blocks, need_bytes, self.policy)
        to_demote: list[Entry] = []
        for key in victims:
            e = s.index[key]
            if e.on_ssd:  # already has an SSD record: demotion is free
                self._finish_demotion(e)
                continue
            action = self.policy.action(blocks[key].candidate, can_demote=s.ssd is not None)
            if action is EvictAction.DEMOTE:
                to_demote.append(e)
            else:
                self._drop_block(e, s.dram_counters)
        if to_demote:
            self._demote(to_demote)
        return len(victims)

    def write_behind(self, limit: int) -> int:
        """Write to SSD, ahead of their eviction, DRAM-only blocks that an eviction would
        demote, in the order it would pick them (the policy's, when the plan was made): at
        most ``limit`` bytes of them, at least one block. They stay in DRAM (a hit reads
        them there; `Entry.tier` is still DRAM, no event), and an eviction that picks them
        later drops the DRAM copy without writing (``evict_dram``). The plan (every such
        block, coldest first) is made when the last one is used up; blocks that have left
        DRAM or reached SSD meanwhile are skipped. Never makes room on SSD for them:
        nothing is written where the SSD tier would cross its high watermark. Returns the
        bytes of the blocks written (0: nothing to do)."""
        s = self.s
        if s.ssd is None or s.dram is None:
            return 0
        if not self._behind:
            self._behind = deque(self._write_behind_plan())
        chosen: list[Entry] = []
        size = 0
        while self._behind:
            e = s.index.get(self._behind[0])
            if e is None or e.on_ssd or e.dram is None:
                self._behind.popleft()
                continue
            if chosen and size + e.nbytes > limit:
                break
            self._behind.popleft()
            chosen.append(e)
            size += e.nbytes
        if not chosen:
            return 0
        records = self._ssd_records(chosen)
        if s.ssd.used + s.ssd.footprint(records) > s.ssd.capacity * self.high:
            self._behind.clear()
            return 0
        s.ssd.write_many(records)
        s.ssd_counters.bytes_written += sum(len(r) for _, r in records)
        for e in chosen:
            e.on_ssd = True
        return size

    def _write_behind_plan(self) -> list[BlockKey]:
        """Every DRAM-only block an eviction would demote, in its order."""
        s = self.s
        assert s.dram is not None
        blocks = self.tier_blocks(Tier.DRAM)
        return [
            key
            for key in select_victims(blocks, s.dram.used, self.policy)
            if not s.index[key].on_ssd
            and self.policy.action(blocks[key].candidate, can_demote=True) is EvictAction.DEMOTE
        ]

    def _demote(self, entries: list[Entry]) -> None:
        s = self.s
        assert s.ssd is not None and s.dram is not None
        records = self._ssd_records(entries)
        total = s.ssd.footprint(records)
        if not self.make_ssd_room(total, frozenset(e.key for e in entries)):
            logger.warning(
                "demotion: SSD cannot take %d bytes; dropping %d last copies", total, len(entries)
            )
            for e in entries:
                self._drop_block(e, s.dram_counters)
            return
        s.ssd.write_many(records)
        s.ssd_counters.bytes_written += sum(len(r) for _, r in records)
        for e in entries:
            e.on_ssd = True
            self._finish_demotion(e)

    def _ssd_records(self, entries: list[Entry]) -> list[tuple[BlockKey, bytes]]:
        """The SSD records of the DRAM copies of ``entries`` (those with one)."""
        s = self.s
        assert s.ssd is not None and s.dram is not None
        return [
            (e.key, s.ssd.encode(s.dram.view(e.dram, e.nbytes), e.checksum, e.parent, e.tenant))
            for e in entries
            if e.dram is not None
        ]

    def _finish_demotion(self, e: Entry) -> None:
        self.drop_dram_copy(e)
        self.s.dram_counters.demotions += 1
        self.s.emit(BlockStored(e.key, Tier.SSD, e.nbytes, e.parent))

    def _drop_block(self, e: Entry, counters: TierCounters) -> None:
        """Remove ``e`` from this node entirely (both tiers) and announce it."""
        if e.dram is not None:
            self.drop_dram_copy(e)
        if e.on_ssd and self.s.ssd is not None:
            self.s.ssd.delete_many([e.key])
            e.on_ssd = False
        del self.s.index[e.key]
        counters.evictions += 1
        self.s.emit(BlockRemoved(e.key))

    # ----------------------------------------------------------------- SSD

    def make_ssd_room(self, need_bytes: int, protect: frozenset[bytes] = frozenset()) -> bool:
        """Ensure ``need_bytes`` more fit in the SSD tier, dropping SSD records by policy down
        to the low watermark when the high one would be crossed. False if impossible."""
        s = self.s
        ssd = s.ssd
        if ssd is None or need_bytes > ssd.capacity:
            return False
        if ssd.used + need_bytes <= ssd.capacity * self.high:
            return True
        self.evict_ssd(int(ssd.used + need_bytes - ssd.capacity * self.low), protect)
        return ssd.used + need_bytes <= ssd.capacity

    def evict_ssd(self, need_bytes: int, protect: frozenset[bytes] = frozenset()) -> int:
        """Drop SSD records by policy freeing >= ``need_bytes`` if possible; a block also in
        DRAM loses only its SSD copy. Returns the records dropped."""
        s = self.s
        assert s.ssd is not None
        victims = select_victims(self.tier_blocks(Tier.SSD, protect), need_bytes, self.policy)
        for key in victims:
            e = s.index[key]
            if e.dram is not None:  # still in DRAM: only the SSD copy goes
                s.ssd.delete_many([key])
                e.on_ssd = False
                s.ssd_counters.evictions += 1
            else:
                self._drop_block(e, s.ssd_counters)
        return len(victims)

    def promote(self, e: Entry, src: np.ndarray) -> bool:
        """Copy a verified SSD hit (``src``, the caller's buffer) into DRAM. The SSD record is
        kept, so demoting it again is free. False if DRAM has no room."""
        s = self.s
        if s.dram is None or e.dram is not None:
            return False
        offset = self.reserve_dram(e.nbytes, frozenset((e.key,)))
        if offset is None or e.key not in s.index:
            if offset is not None:
                s.dram.free(offset, e.nbytes)
            return False
        s.dram.view(offset, e.nbytes)[:] = src
        e.dram = offset
        s.ssd_counters.promotions += 1
        s.emit(BlockStored(e.key, Tier.DRAM, e.nbytes, e.parent))
        return True

    def put_ssd(
        self, key: BlockKey, src: np.ndarray, parent: BlockKey | None, now: int, tenant: str
    ) -> Tier | None:
        """Store a new block of ``tenant`` straight on SSD (DRAM had no room). None if SSD
        cannot take it."""
        s = self.s
        if s.ssd is None:
            return None
        csum = block_checksum(key, parent, tenant, src)
        record = s.ssd.encode(src, csum, parent, tenant)
        if not self.make_ssd_room(s.ssd.footprint([(key, record)])):
            return None
        s.ssd.write_many([(key, record)])
        e = Entry(key, src.shape[0], csum, parent, now, tenant)
        e.on_ssd = True
        s.index[key] = e
        s.ssd_counters.bytes_written += len(record)
        s.emit(BlockStored(key, Tier.SSD, e.nbytes, parent))
        return Tier.SSD

    def free_removed(self, e: Entry) -> None:
        """Release the DRAM extent and SSD record of ``e``, already out of the index (its SSD
        record is kept if a new entry of the same key has written one since)."""
        s = self.s
        if e.dram is not None:
            self.drop_dram_copy(e)
        if e.on_ssd and s.ssd is not None:
            current = s.index.get(e.key)
            if current is None or not current.on_ssd:
                s.ssd.delete_many([e.key])
            e.on_ssd = False

    def discard_corrupt(self, e: Entry, tier: Tier) -> None:
        """Drop the copy of ``e`` in ``tier`` that failed its checksum; if no copy is left,
        remove the block and announce it. A DRAM copy other readers are still copying is left
        for them to find (and report) too."""
        s = self.s
        if tier is Tier.DRAM:
            if e.readers or e.dram is None:
                return
            self.drop_dram_copy(e)
            if e.on_ssd:
                s.emit(BlockStored(e.key, Tier.SSD, e.nbytes, e.parent))
                return
        elif e.on_ssd and s.ssd is not None:
            s.ssd.delete_many([e.key])
            e.on_ssd = False
            if e.dram is not None:
                return
        if not e.readers and e.dram is None and not e.on_ssd:
            del s.index[e.key]
            if e.pins:
                s.lost_pins[e.key] = s.lost_pins.get(e.key, 0) + e.pins
            s.emit(BlockRemoved(e.key))

    def adopt_ssd(self) -> int:
        """Register every valid record already in the SSD engine (a restart); corrupt ones are
        deleted and counted. Then trim to capacity if it shrank. Returns blocks adopted."""
        s = self.s
        assert s.ssd is not None
        adopted = 0
        for record in s.ssd.adopt():
            header = record.header
            e = Entry(record.key, header.raw_len, header.checksum, header.parent, 0, header.tenant)
            e.on_ssd = True
            s.index[record.key] = e
            adopted += 1
        s.ssd_counters.corruptions += len(s.ssd.corrupt_keys)
        if s.ssd.used > s.ssd.capacity:
            self.make_ssd_room(0)
        return adopted

    def flush_dram(self) -> int:
        """Write every DRAM-only block to SSD (most recent first) while it fits; for a clean
        close. Blocks stay in DRAM. Returns the number written."""
        s = self.s
        if s.ssd is None or s.dram is None:
            return 0
        pending = sorted(
            (e for e in s.index.values() if e.dram is not None and not e.on_ssd),
            key=lambda e: -e.last_access,
        )
        written = 0
        while pending:
            chunk: list[Entry] = []
            size = 0
            while pending and size < _FLUSH_CHUNK_BYTES:
                chunk.append(pending.pop(0))
                size += chunk[-1].nbytes
            records = self._ssd_records(chunk)
            total = s.ssd.footprint(records)
            if not self.make_ssd_room(total, frozenset(e.key for e in chunk)):
                logger.warning("flush on close: SSD full; %d blocks not written", len(chunk))
                break
            s.ssd.write_many(records)
            for e in chunk:
                e.on_ssd = True
            written += len(chunk)
        return written
