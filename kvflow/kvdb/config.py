"""StoreConfig: everything one node's shard is configured with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ENGINES = ("lmdb", "rocksdb", "memory")
# The SSD engine a new data directory gets where none is configured (one that already holds a
# tier keeps its engine: ``manifest.engine_for``). LMDB: kvflow's records are fixed-size
# blocks of MiBs, written once under random keys. RocksDB's leveled compaction rewrites them,
# and its flush and compaction threads cost ~4-6 s of CPU per GB demoted beside the engine
# (BENCHMARKS.md, "The SSD tier's write path"); an LMDB write is one copy into its map.
DEFAULT_ENGINE = "lmdb"
COMPRESSIONS = ("none", "zstd")


@dataclass(frozen=True)
class StoreConfig:
    """Configuration of one node's shard (frozen; ``__post_init__`` raises ValueError naming
    the field).

    Fields:
        data_dir: directory of the SSD tier and its manifest; required for "rocksdb"/"lmdb",
            optional for "memory" (then only the manifest is written there).
        dram_capacity_bytes: size of the one preallocated DRAM pool (>= 0; 0 = no DRAM tier,
            puts land on SSD).
        ssd_capacity_bytes: bytes of records the SSD tier may hold (>= 0; 0 = no SSD tier,
            DRAM evictions drop).
        engine: SSD storage engine: "lmdb" (``DEFAULT_ENGINE``), "rocksdb" or "memory" (tests).
        eviction: eviction policy name from ``kvdb.eviction.POLICIES``:
            "prefix_replica_lru" (default) or "lru".
        high_watermark: fraction of a tier's capacity above which it evicts (0 < hw <= 1).
        low_watermark: fraction it evicts down to (0 <= lw < hw).
        promote_on_hit: copy a block read from SSD into DRAM.
        compression: SSD payload codec, "none" or "zstd".
        compression_level: zstd level, 1..22.
        shuffle_bytes: element width for byte-shuffling before zstd (2 for bf16/fp16; 1 = off;
            None = take it from the namespace's dtype, or 1 if none is known).
        value_size: if set, every value must have exactly this many bytes.
        max_value_size: upper bound on a value's bytes (>= 1).
        dram_alignment: DRAM extents start on multiples of this (power of two, >= 8).
        dram_prefault: touch every page of the pool at open (slower open, no page faults on
            the first puts).
        dram_write_ahead_bytes: how far past its furthest write the DRAM pool may be mapped
            ahead of use when the shard's owner asks (``Shard.write_ahead``, run while the
            engine is idle; ``dram.py``); 0 (the default here): never.
        dram_write_behind: when the shard's owner asks (``Shard.write_behind``, run while the
            engine is idle), write to SSD ahead of time the DRAM blocks an eviction would
            demote, coldest first, once the DRAM tier is half full, so that an eviction
            under load drops DRAM copies instead of writing them (``mover.py``); False (the
            default here): demotions write on the storing thread.
        dram_shared: the pool is a shared pool (a sealed memfd, ``transfer/pool_memory.py``)
            that the transfer engine hands to authenticated same-host peers, which then read
            it by memcpy (default); False: private memory, for a store no other process reads
            (the embedded server's; its first writes fault ~10% faster).
        verify_dram_hits: verify a DRAM block's checksum on every local read (default). False:
            a DRAM hit is one copy. The pool is written by this shard's puts alone (peers
            read it through a segment registered read-only for them), so the check guards
            only against this process's own memory bugs; SSD records and remote reads are
            verified either way.
        flush_on_close: on close, write DRAM-only blocks to SSD so a clean restart loses nothing.
        event_outbox_capacity: events kept for ``take_events()`` before the oldest are dropped.
        metadata_flush_interval_s: period of the background metadata flusher (> 0).
        lmdb_map_size_bytes: LMDB map size; None = 2 * ssd_capacity_bytes + 64 MiB.
    """

    data_dir: Path | None = None
    dram_capacity_bytes: int = 256 * 1024 * 1024
    ssd_capacity_bytes: int = 1024 * 1024 * 1024
    engine: str = DEFAULT_ENGINE
    eviction: str = "prefix_replica_lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    promote_on_hit: bool = True
    compression: str = "none"
    compression_level: int = 3
    shuffle_bytes: int | None = None
    value_size: int | None = None
    max_value_size: int = 64 * 1024 * 1024
    dram_alignment: int = 256
    dram_prefault: bool = False
    dram_write_ahead_bytes: int = 0
    dram_write_behind: bool = False
    dram_shared: bool = True
    verify_dram_hits: bool = True
    flush_on_close: bool = True
    event_outbox_capacity: int = 65536
    metadata_flush_interval_s: float = 0.05
    lmdb_map_size_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.data_dir is not None and not isinstance(self.data_dir, Path):
            object.__setattr__(self, "data_dir", Path(self.data_dir))
        _check_int(self, "dram_capacity_bytes", 0)
        _check_int(self, "ssd_capacity_bytes", 0)
        if self.engine not in ENGINES:
            raise ValueError(f"StoreConfig.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine != "memory" and self.data_dir is None:
            raise ValueError(f"StoreConfig.data_dir is required for engine {self.engine!r}")
        from kvflow.kvdb.eviction import POLICIES

        if self.eviction not in POLICIES:
            raise ValueError(
                f"StoreConfig.eviction must be one of {sorted(POLICIES)}, got {self.eviction!r}"
            )
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(
                f"StoreConfig.high_watermark must be in (0, 1], got {self.high_watermark!r}"
            )
        if not 0.0 <= self.low_watermark < self.high_watermark:
            raise ValueError(
                "StoreConfig.low_watermark must be in [0, high_watermark), "
                f"got {self.low_watermark!r}"
            )
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"StoreConfig.compression must be one of {COMPRESSIONS}, got {self.compression!r}"
            )
        if not 1 <= self.compression_level <= 22:
            raise ValueError(
                f"StoreConfig.compression_level must be in 1..22, got {self.compression_level!r}"
            )
        if self.shuffle_bytes is not None and self.shuffle_bytes not in (1, 2, 4, 8):
            raise ValueError(
                f"StoreConfig.shuffle_bytes must be None, 1, 2, 4 or 8, got {self.shuffle_bytes!r}"
            )
        _check_int(self, "max_value_size", 1)
        if self.value_size is not None:
            _check_int(self, "value_size", 1)
            if self.value_size > self.max_value_size:
                raise ValueError("StoreConfig.value_size must be <= max_value_size")
        a = self.dram_alignment
        if not isinstance(a, int) or a < 8 or a & (a - 1):
            raise ValueError(f"StoreConfig.dram_alignment must be a power of two >= 8, got {a!r}")
        for flag in ("dram_prefault", "dram_write_behind", "dram_shared", "verify_dram_hits"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"StoreConfig.{flag} must be a bool, got {getattr(self, flag)!r}")
        _check_int(self, "dram_write_ahead_bytes", 0)
        _check_int(self, "event_outbox_capacity", 1)
        if not self.metadata_flush_interval_s > 0:
            raise ValueError("StoreConfig.metadata_flush_interval_s must be > 0")
        if self.lmdb_map_size_bytes is not None:
            _check_int(self, "lmdb_map_size_bytes", 1 << 20)

    def ssd_dir(self) -> Path | None:
        """Where the storage engine keeps its files (``data_dir / "ssd"``)."""
        return None if self.data_dir is None else self.data_dir / "ssd"


def _check_int(config: StoreConfig, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"StoreConfig.{name} must be an int >= {minimum}, got {value!r}")
