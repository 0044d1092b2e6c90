"""Shard: one node's tiered block store (DRAM pool over an SSD engine).

Thread-safety: every public method is thread-safe. One lock guards the index, allocator,
counters and outbox; the bulk copies of put and get_into run OUTSIDE it (reader counts keep an
extent or record alive while it is copied), so concurrent readers copy in parallel. Tier moves
(eviction, demotion, promotion) run under the lock.

Keys are 16-byte ``BlockKey``s; values are raw bytes (any contiguous buffer). A key names its
content (a chained hash), so a put of a key already held is a no-op that refreshes its recency.
Every block records its owner tenant (the namespace it was put under; kept in its SSD record,
so it survives a restart): the admin views filter on it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from kvflow.kvdb.buffers import readable_bytes, writable_bytes
from kvflow.kvdb.codec import copy_and_checksum, key_seed, verified_copy
from kvflow.kvdb.config import StoreConfig
from kvflow.kvdb.copier import run_all
from kvflow.kvdb.dram import DramTier
from kvflow.kvdb.engines import StorageEngine
from kvflow.kvdb.entry import BlockInfo, Entry
from kvflow.kvdb.errors import (
    BlockPinnedError,
    ChecksumError,
    DataDirInUseError,
    InvalidKeyError,
    NotPinnedError,
    StorageEngineError,
    StoreClosedError,
    ValueSizeError,
)
from kvflow.kvdb.events import BlockEvent, BlockRemoved, BlockStored, Outbox
from kvflow.kvdb.eviction import POLICIES
from kvflow.kvdb.keys import DEFAULT_TENANT, KEY_BYTES, BlockKey, check_tenant
from kvflow.kvdb.mover import ShardState, TierMover
from kvflow.kvdb.remote.dram_lease import (
    HotBlock,
    LeasedBlock,
    hottest,
    lease_leading,
    release_pins,
)
from kvflow.kvdb.replicas import LocalReplicas, ReplicaCounter
from kvflow.kvdb.ssd import SsdTier
from kvflow.kvdb.stats import StoreStats, TenantUsage, TierCounters, snapshot, tenant_usage
from kvflow.kvdb.tier_repair import check_manifest, open_engine, reopen_empty
from kvflow.replication import NodeId, Tier
from kvflow.replication.dir_guard import DirClaim, DirInUseError, claim_dir

logger = logging.getLogger(__name__)

LOCAL_NODE = NodeId("local")
"""The node id of a shard that is not part of a cluster."""


WRITE_AHEAD_CHUNK = 2 << 20
"""Bytes ``Shard.write_ahead`` maps per call: ~1-5 ms here (2-10 us a 4 KiB page on a
virtual machine), what a request arriving meanwhile may wait."""

WRITE_BEHIND_CHUNK = 4 << 20
"""Bytes of blocks ``Shard.write_behind`` writes to SSD per call (at least one block): a
block of SmolLM2-135M's 64 tokens (2.8 MiB) into LMDB took 3.2 ms (median; 9.2 ms at most)
here, under the shard's lock."""
WRITE_BEHIND_FROM = 0.5
"""The DRAM tier's fill (a fraction of its capacity) from which ``Shard.write_behind`` works."""


def _copy(dst: np.ndarray, src: np.ndarray) -> bool:
    np.copyto(dst, src)  # releases the GIL (copier.py)
    return True


def check_key(key: bytes) -> BlockKey:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InvalidKeyError(f"a BlockKey is {KEY_BYTES} bytes, got {key!r:.60}")
    return BlockKey(key)


class Shard:
    """One node's share of the store. Opening re-adopts the SSD records already in
    ``config.data_dir`` (a restart loses no SSD data, except RocksDB's records not yet flushed
    from its memtables when the process was killed; with ``flush_on_close`` a clean close
    loses no DRAM data either).

    Raises at open: IncompatibleDataDirError (other format version or engine),
    NamespaceMismatchError (data dir of another model fingerprint), DataDirInUseError (another
    live process holds ``data_dir``; the shard holds ``data_dir/LOCK`` until ``close``),
    StorageEngineError. A damaged SSD tier or manifest is moved aside and the shard starts
    with an empty tier (``tier_repair``).
    """

    def __init__(
        self,
        config: StoreConfig,
        fingerprint: str,
        node_id: NodeId = LOCAL_NODE,
        replicas: ReplicaCounter | None = None,
        shuffle_bytes: int = 1,
        engine: StorageEngine | None = None,
    ) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.node_id = node_id
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        self._clock = 0
        self._writing: set[bytes] = set()
        self._puts = 0
        self._rejected = 0
        self.events = Outbox(config.event_outbox_capacity)
        self._outboxes: list[Outbox] = [self.events]
        self._dir_claim: DirClaim | None = None
        if config.data_dir is not None:
            try:
                self._dir_claim = claim_dir(config.data_dir, "kvdb data dir")
            except DirInUseError as exc:
                raise DataDirInUseError(str(exc)) from None
        try:
            self._open_tiers(config, shuffle_bytes, engine, replicas)
        except BaseException:
            self._release_dir()
            raise

    def _open_tiers(
        self,
        config: StoreConfig,
        shuffle_bytes: int,
        engine: StorageEngine | None,
        replicas: ReplicaCounter | None,
    ) -> None:
        fingerprint = self.fingerprint
        if config.data_dir is not None:
            check_manifest(config, fingerprint)
        dram = DramTier(
            config.dram_capacity_bytes, config.dram_alignment, config.dram_prefault,
            config.dram_shared,
        )  # fmt: skip
        ssd: SsdTier | None = None
        map_size = config.lmdb_map_size_bytes or (2 * config.ssd_capacity_bytes + (64 << 20))
        if config.ssd_capacity_bytes > 0:
            if engine is None:
                engine = open_engine(config, map_size)
            ssd = SsdTier(
                engine,
                config.ssd_capacity_bytes,
                compress=config.compression == "zstd",
                level=config.compression_level,
                shuffle=shuffle_bytes,
            )
        self._state = ShardState(
            index={},
            dram=dram if dram.capacity else None,
            ssd=ssd,
            dram_counters=TierCounters(),
            ssd_counters=TierCounters(),
            emit=self._emit,
        )
        self._mover = TierMover(
            self._state,
            POLICIES[config.eviction](),
            replicas or LocalReplicas(),
            config.high_watermark,
            config.low_watermark,
        )
        if ssd is not None:
            with self._lock:
                try:
                    adopted = self._mover.adopt_ssd()
                except StorageEngineError as exc:  # records that cannot be read back
                    self._state.index.clear()
                    ssd.sizes.clear()
                    ssd.used = 0
                    ssd.engine = reopen_empty(config, map_size, ssd.engine, exc)
                    adopted = 0
            if adopted:
                logger.info(
                    "shard node=%s re-adopted %d SSD blocks (%d bytes)",
                    self.node_id,
                    adopted,
                    ssd.used,
                )

    def _release_dir(self) -> None:
        claim, self._dir_claim = self._dir_claim, None
        if claim is not None:
            claim.release()

    # ------------------------------------------------------------------ plumbing

    def _emit(self, event: BlockEvent) -> None:
        for outbox in self._outboxes:
            outbox.append(event)

    def add_outbox(self, outbox: Outbox) -> None:
        """Also append every future event to ``outbox`` (e.g. the metadata sync's)."""
        with self._lock:
            self._outboxes.append(outbox)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"shard node={self.node_id} is closed")

    def _check_value_size(self, nbytes: int) -> None:
        cfg = self.config
        if cfg.value_size is not None and nbytes != cfg.value_size:
            raise ValueSizeError(f"value has {nbytes} bytes, the store takes {cfg.value_size}")
        if nbytes == 0 or nbytes > cfg.max_value_size:
            raise ValueSizeError(
                f"value has {nbytes} bytes; allowed 1..{cfg.max_value_size} (max_value_size)"
            )

    def _release(self) -> None:
        self._inflight -= 1
        if self._inflight == 0 and self._closed:
            self._idle.notify_all()

    # ------------------------------------------------------------------ writes

    def put(
        self,
        key: bytes,
        value: Any,
        parent: bytes | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> Tier | None:
        """Store ``value`` (bytes-like, numpy or torch CPU; copied, the caller keeps it) as a
        block owned by ``tenant`` (the tenant of the namespace its key was made in).

        Returns the tier it landed in (DRAM unless DRAM cannot make room), the current tier if
        the key is already held (no write; the owner stays the first put's), or None if no tier
        could take it (counted in ``rejected_puts``). Raises InvalidKeyError, ValueSizeError,
        InvalidBufferError, ValueError (a malformed tenant), StoreFullError (the device is
        full: the block is not stored, nothing else is lost).
        """
        key = check_key(key)
        if parent is not None:
            parent = check_key(parent)
        check_tenant(tenant)
        src = readable_bytes(value)
        self._check_value_size(src.shape[0])
        nbytes = src.shape[0]
        with self._lock:
            self._check_open()
            self._puts += 1
            e = self._state.index.get(key)
            if e is not None:
                e.last_access = self._tick()
                return e.tier
            if key in self._writing:
                return Tier.DRAM
            offset = self._mover.reserve_dram(nbytes)
            if offset is None:
                tier = self._mover.put_ssd(
                    key, src, BlockKey(parent) if parent else None, self._tick(), tenant
                )
                self._rejected += tier is None
                return tier
            self._writing.add(key)
            self._inflight += 1
        dram = self._state.dram
        assert dram is not None
        try:
            seed = key_seed(key, parent, tenant)
            csum = copy_and_checksum(dram.view(offset, nbytes), src, seed)
        except BaseException:
            with self._lock:
                self._writing.discard(key)
                dram.free(offset, nbytes)
                self._release()
            raise
        with self._lock:  # publish and release together: close() cannot slip in between
            self._writing.discard(key)
            parent_key = BlockKey(parent) if parent else None
            e = Entry(key, nbytes, csum, parent_key, self._tick(), tenant)
            e.dram = offset
            self._state.index[key] = e
            self._state.dram_counters.bytes_written += nbytes
            self._emit(BlockStored(key, Tier.DRAM, nbytes, e.parent))
            self._release()
        return Tier.DRAM

    def remove(self, key: bytes) -> bool:
        """Remove ``key`` from every tier. False if absent; BlockPinnedError if pinned. A block
        being read is removed from the index now and freed when its readers finish."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            e = self._state.index.get(key)
            if e is None:
                return False
            if e.pins:
                raise BlockPinnedError(f"key={key.hex()} is pinned ({e.pins} pins)")
            del self._state.index[key]
            if e.readers:
                e.doomed = True  # freed by its last reader
            else:
                self._mover.free_removed(e)
            self._emit(BlockRemoved(e.key))
            return True

    # ------------------------------------------------------------------ reads

    def get_into(self, key: bytes, buf: Any) -> Tier | None:
        """Copy ``key``'s value into ``buf`` (writable memoryview / numpy / torch CPU tensor of
        exactly the value's size). Returns the tier that served it, or None on a miss (buf
        untouched) or a corrupted record (a DRAM block is verified before it is copied, so buf is
        untouched; an SSD record after, so buf holds unspecified bytes; the record is removed
        and counted). Raises ValueSizeError (nothing written) on a size mismatch."""
        key = check_key(key)
        dst = writable_bytes(buf)
        s = self._state
        with self._lock:
            self._check_open()
            e = s.index.get(key)
            if e is None:
                s.dram_counters.misses += 1
                s.ssd_counters.misses += 1
                return None
            if e.nbytes != dst.shape[0]:
                raise ValueSizeError(
                    f"buffer has {dst.shape[0]} bytes, key={key.hex()} holds {e.nbytes}"
                )
            e.last_access = self._tick()
            e.readers += 1
            self._inflight += 1
            tier, offset = e.tier, e.dram
        ok = False
        try:
            ok = self._read(e, tier, offset, dst)
        finally:
            with self._lock:
                e.readers -= 1
                self._release()
                result = self._after_read(e, tier, ok, dst)
        return result

    def get_many_into(self, keys: Sequence[bytes], bufs: Sequence[Any]) -> list[Tier | int | None]:
        """``get_into`` for many keys: the lock taken twice for the batch, not twice a key, and
        the copies of a large batch on two threads (copier.py). Per key: the tier that served
        it; None on a miss or a corrupted record (as ``get_into``); or, where its buffer's
        size is not the value's, that size (an int; nothing written to the buffer)."""
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        checked = [check_key(k) for k in keys]
        dsts = [writable_bytes(b) for b in bufs]
        out: list[Tier | int | None] = [None] * len(checked)
        reads: list[tuple[int, Entry, Tier]] = []
        jobs: list[Callable[[], bool]] = []
        s = self._state
        pool = None if s.dram is None or self.config.verify_dram_hits else s.dram.pool
        with self._lock:
            self._check_open()
            for i, key in enumerate(checked):
                e = s.index.get(key)
                if e is None:
                    s.dram_counters.misses += 1
                    s.ssd_counters.misses += 1
                elif e.nbytes != dsts[i].shape[0]:
                    out[i] = e.nbytes
                else:
                    self._clock += 1
                    e.last_access = self._clock
                    e.readers += 1
                    offset = e.dram
                    if offset is not None and pool is not None:  # an unverified DRAM hit
                        reads.append((i, e, Tier.DRAM))
                        jobs.append(partial(_copy, dsts[i], pool[offset : offset + e.nbytes]))
                    else:
                        reads.append((i, e, e.tier))
                        jobs.append(partial(self._read, e, e.tier, offset, dsts[i]))
            self._inflight += len(reads)
        oks = [False] * len(reads)
        try:
            oks = run_all(jobs, [e.nbytes for _, e, _ in reads])
        finally:
            with self._lock:
                counters = s.dram_counters
                for (i, e, tier), ok in zip(reads, oks, strict=True):
                    e.readers -= 1
                    if ok and tier is Tier.DRAM and not e.doomed:  # the common case, inline
                        e.hits += 1
                        counters.hits += 1
                        counters.bytes_read += e.nbytes
                        out[i] = tier
                    else:
                        out[i] = self._after_read(e, tier, ok, dsts[i])
                for _ in reads:
                    self._release()
        return out

    def _read(self, e: Entry, tier: Tier, offset: int | None, dst: np.ndarray) -> bool:
        """The copy + verification, outside the lock."""
        if tier is Tier.DRAM:
            assert self._state.dram is not None and offset is not None
            view = self._state.dram.view(offset, e.nbytes)
            if not self.config.verify_dram_hits:
                dst[:] = view
                return True
            return verified_copy(dst, view, e.checksum, key_seed(e.key, e.parent, e.tenant))
        assert self._state.ssd is not None
        try:
            return self._state.ssd.read_into(e.key, dst)
        except ChecksumError as exc:
            logger.warning("ssd record corrupt node=%s key=%s: %s", self.node_id, e.key.hex(), exc)
            return False

    def _after_read(self, e: Entry, tier: Tier, ok: bool, dst: np.ndarray) -> Tier | None:
        """Bookkeeping after a read (lock held): stats, corruption handling, promotion."""
        s = self._state
        if e.doomed and e.readers == 0:
            e.doomed = False
            self._mover.free_removed(e)
        if ok:
            e.hits += 1
            counters = s.dram_counters if tier is Tier.DRAM else s.ssd_counters
            counters.hits += 1
            counters.bytes_read += e.nbytes
            if tier is Tier.SSD:
                s.dram_counters.misses += 1
                if self.config.promote_on_hit and s.index.get(e.key) is e:
                    self._mover.promote(e, dst)
            return tier
        counters = s.dram_counters if tier is Tier.DRAM else s.ssd_counters
        counters.corruptions += 1
        if s.index.get(e.key) is e:
            logger.warning(
                "corrupt block node=%s key=%s tier=%s", self.node_id, e.key.hex(), tier.name
            )
            self._mover.discard_corrupt(e, tier)
        return None

    def value_sizes(self, keys: Sequence[bytes]) -> list[int | None]:
        """Each key's value size, or None where it is not held (counted as a miss, as a read
        would be; no recency update): one lock for the batch."""
        checked = [check_key(k) for k in keys]
        with self._lock:
            self._check_open()
            index = self._state.index
            out = [None if (e := index.get(k)) is None else e.nbytes for k in checked]
            missed = out.count(None)
            self._state.dram_counters.misses += missed
            self._state.ssd_counters.misses += missed
        return out

    def get(self, key: bytes) -> bytes | None:
        """The value as new bytes, or None (miss or corruption)."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            e = self._state.index.get(key)
            nbytes = None if e is None else e.nbytes
        if nbytes is None:
            return self._miss()
        buf = bytearray(nbytes)
        try:
            tier = self.get_into(key, buf)
        except ValueSizeError:  # replaced by a value of another size meanwhile
            return None
        return None if tier is None else bytes(buf)

    def _miss(self) -> None:
        with self._lock:
            self._check_open()
            self._state.dram_counters.misses += 1
            self._state.ssd_counters.misses += 1
        return None

    def exists(self, key: bytes) -> bool:
        """Whether ``key`` is held in any tier (no recency update, no stats)."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            return key in self._state.index

    def tier_of(self, key: bytes) -> Tier | None:
        """The fastest tier holding ``key``, or None."""
        key = check_key(key)
        with self._lock:
            e = self._state.index.get(key)
            return None if e is None else e.tier

    def info(self, key: bytes) -> BlockInfo | None:
        """Where ``key`` is, its size, parent and owner tenant; None if not held (no recency
        update, no stats): what a copy of the block to another shard needs besides its bytes."""
        key = check_key(key)
        with self._lock:
            e = self._state.index.get(key)
            return None if e is None else BlockInfo(e.key, e.tier, e.nbytes, e.parent, e.tenant)

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """The number of leading ``keys`` held (stops at the first absent one)."""
        checked = [check_key(k) for k in keys]
        with self._lock:
            self._check_open()
            index = self._state.index
            for i, key in enumerate(checked):
                if key not in index:
                    return i
            return len(checked)

    # ------------------------------------------------------------------ pins

    def pin(self, keys: Sequence[bytes]) -> list[bool]:
        """Add one pin to each held key (pins are counted); a pinned block is never evicted.
        Returns, per key, whether it was held (and is now pinned)."""
        checked = [check_key(k) for k in keys]
        with self._lock:
            self._check_open()
            out = []
            for key in checked:
                e = self._state.index.get(key)
                if e is not None:
                    e.pins += 1
                out.append(e is not None)
            return out

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Drop one pin from each key. Raises NotPinnedError (and changes nothing) if a key
        (counting repeats) holds fewer pins than asked. A pinned block that was removed since
        because its last copy failed its checksum still owes its pins: unpinning it is fine
        (those owed pins are dropped first)."""
        checked = [check_key(k) for k in keys]
        with self._lock:
            wanted: dict[bytes, int] = {}
            for key in checked:
                wanted[key] = wanted.get(key, 0) + 1
            lost = self._state.lost_pins
            for key, n in wanted.items():
                e = self._state.index.get(BlockKey(key))
                if (0 if e is None else e.pins) + lost.get(BlockKey(key), 0) < n:
                    raise NotPinnedError(f"key={key.hex()} holds fewer than {n} pins")
            for key, n in wanted.items():
                owed = min(n, lost.get(BlockKey(key), 0))
                if owed:
                    lost[BlockKey(key)] -= owed
                    if not lost[BlockKey(key)]:
                        del lost[BlockKey(key)]
                if n > owed:
                    self._state.index[BlockKey(key)].pins -= n - owed

    def num_pinned(self) -> int:
        """Blocks holding at least one pin, plus removed (corrupt) blocks whose pins were not
        dropped yet (a leak check for callers that pin)."""
        with self._lock:
            index = self._state.index
            held = sum(1 for e in index.values() if e.pins > 0)
            lost = (k for k in self._state.lost_pins if k not in index or not index[k].pins)
            return held + sum(1 for _ in lost)

    def evict(self, tier: Tier, nbytes: int) -> int:
        """Evict at least ``nbytes`` from ``tier`` now, by the configured policy (an admin
        action; normally the watermarks drive eviction). DRAM victims are demoted or dropped
        per the policy, SSD victims dropped. Returns the blocks evicted."""
        with self._lock:
            self._check_open()
            if tier is Tier.DRAM:
                return 0 if self._state.dram is None else self._mover.evict_dram(nbytes)
            return 0 if self._state.ssd is None else self._mover.evict_ssd(nbytes)

    def write_ahead(self, chunk: int = WRITE_AHEAD_CHUNK) -> int:
        """Map up to ``chunk`` more bytes of the DRAM pool ahead of its first writes, until
        ``config.dram_write_ahead_bytes`` past the furthest block stored are mapped
        (``dram.py``). For the shard's owner to call while its engine is idle (a request
        arriving meanwhile waits for at most one chunk). Returns the bytes mapped now; 0
        when there is nothing to do (no DRAM tier, nothing stored yet, the reserve complete,
        the shard closed). Not from several threads at once."""
        dram = self._state.dram
        if dram is None or self._closed:
            return 0
        return dram.write_ahead(self.config.dram_write_ahead_bytes, chunk)

    def write_behind(self, chunk: int = WRITE_BEHIND_CHUNK) -> int:
        """Write to SSD up to ``chunk`` bytes (at least one block) of the DRAM-only blocks
        that evictions would demote, coldest first, once the DRAM tier is
        `WRITE_BEHIND_FROM` full (``config.dram_write_behind``; ``TierMover.write_behind``).
        They stay in DRAM; an eviction under load then drops their DRAM copies instead of
        writing them on the storing thread, beside the engine. For the shard's owner to call
        while its engine is idle (a request arriving meanwhile waits for one call). Returns
        the bytes written now; 0 when there is nothing to do (off, no DRAM or SSD tier, the
        tier less full, every such block written, SSD near its high watermark, closed)."""
        s = self._state
        if not self.config.dram_write_behind or s.dram is None or s.ssd is None:
            return 0
        with self._lock:
            if self._closed or s.dram.used < s.dram.capacity * WRITE_BEHIND_FROM:
                return 0
            return self._mover.write_behind(chunk)

    def dram_marks(self) -> tuple[int, int]:
        """(high water, mapped) of the DRAM pool: the end of the furthest extent ever
        allocated, and of the span mapped ahead of use (``write_ahead``) or at open
        (``dram_prefault``); (0, 0) without a DRAM tier."""
        dram = self._state.dram
        return (0, 0) if dram is None else (dram.high_water, dram.mapped)

    # ------------------------------------------------------------------ remote reads

    @property
    def dram_pool(self) -> np.ndarray | None:
        """The DRAM tier's whole preallocated pool (uint8, fixed for the shard's life), to
        register as a transfer segment; None without a DRAM tier. Its bytes are only
        meaningful inside extents handed out by ``lease_dram``."""
        return None if self._state.dram is None else self._state.dram.pool

    def lease_dram(self, keys: Sequence[bytes], promote: bool = True) -> list[LeasedBlock]:
        """Pin the leading ``keys`` held in DRAM (with ``promote``, an SSD-only block is first
        read into DRAM) and return where each lies in ``dram_pool``; stops at the first key
        that is absent or cannot be brought into DRAM. Each returned block holds one pin until
        ``release_dram`` (the caller must release exactly what it got). Counts as hits."""
        checked = [check_key(k) for k in keys]
        with self._lock:
            self._check_open()
            return lease_leading(self._state, self._mover, checked, promote, self._tick())

    def release_dram(self, keys: Sequence[bytes]) -> int:
        """Drop the pins of a ``lease_dram`` (keys no longer held are skipped, never an error;
        works after close). Returns the pins dropped."""
        checked = [check_key(k) for k in keys]
        with self._lock:
            return release_pins(self._state, checked)

    def hot(self, n: int, tenant: str | None = None) -> list[HotBlock]:
        """The ``n`` most-read blocks (hits counted per block since it was stored), of every
        tenant or only of ``tenant``."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            return hottest(self._state, n, tenant)

    # ------------------------------------------------------------------ state

    def holdings(self) -> list[tuple[bytes, Tier]]:
        """(key, fastest tier) of every block held: what the metadata should record."""
        with self._lock:
            return [(e.key, e.tier) for e in self._state.index.values()]

    def stats(self, reset: bool = False) -> StoreStats:
        """A snapshot of per-tier counters and usage; ``reset`` zeroes the counters."""
        with self._lock:
            s = self._state
            snap = snapshot(
                s.index.values(),
                s.dram,
                s.ssd,
                s.dram_counters,
                s.ssd_counters,
                puts=self._puts,
                rejected=self._rejected,
                dropped=self.events.dropped,
            )
            if reset:
                s.dram_counters.reset()
                s.ssd_counters.reset()
                self._puts = self._rejected = 0
            return snap

    def tenant_usage(self, tenant: str) -> TenantUsage:
        """What ``tenant`` holds here now (blocks, bytes, hits of its blocks): computed from
        the index on the call, one pass, like ``stats``."""
        with self._lock:
            return tenant_usage(self._state.index.values(), tenant)

    def take_events(self) -> list[BlockEvent]:
        """Drain this shard's default outbox (oldest first)."""
        return self.events.take()

    def close(self) -> None:
        """Wait for in-flight copies, flush DRAM-only blocks to SSD (``flush_on_close``), and
        close the engine. Idempotent; later calls on the shard raise StoreClosedError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._inflight:
                self._idle.wait()
            ssd = self._state.ssd
            if ssd is not None:
                if self.config.flush_on_close:
                    try:
                        n = self._mover.flush_dram()
                        logger.info("shard node=%s flushed %d DRAM blocks to SSD", self.node_id, n)
                    except Exception:
                        logger.exception("shard node=%s: flush on close failed", self.node_id)
                ssd.engine.close()
            self._release_dir()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
