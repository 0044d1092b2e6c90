"""The DRAM tier's write-ahead (``dram.py``): the pool mapped past its furthest write, ahead of
the next stores, without changing a byte; nothing before the first block; bounded by the
reserve and the pool; a shard does it as its config says (``dram_write_ahead_bytes``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from kvflow.kvdb import StoreConfig
from kvflow.kvdb.dram import DramTier
from kvflow.transfer.pool_memory import populate
from tests.kvdb.conftest import NBYTES, keys, value
from tests.stages.engine.test_resident_pages import _resident_share

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE, mincore")
MIB = 1 << 20


def resident(region: np.ndarray, start: int, end: int) -> float:
    """The share of the OS pages wholly inside ``region[start:end]`` that are resident."""
    return _resident_share(torch.from_numpy(region[start:end]))


@linux_only
def test_populate_maps_a_span_and_changes_no_byte() -> None:
    tier = DramTier(16 * MIB, 256)
    pool = tier.pool
    pool[5 * MIB : 5 * MIB + 7] = 42  # written bytes inside the span stay as they are
    assert resident(pool, 4 * MIB, 8 * MIB) < 0.1
    assert populate(pool, 4 * MIB + 100, 8 * MIB - 100)  # widened to whole pages
    assert resident(pool, 4 * MIB, 8 * MIB) == 1.0
    assert resident(pool, 9 * MIB, 16 * MIB) < 0.1  # nothing past the span
    assert (pool[5 * MIB : 5 * MIB + 7] == 42).all() and pool[4 * MIB : 5 * MIB].max() == 0
    with pytest.raises(ValueError, match="outside a region"):
        populate(pool, 0, 17 * MIB)


@linux_only
def test_write_ahead_maps_the_reserve_past_the_high_water_in_chunks() -> None:
    tier = DramTier(32 * MIB, 256)
    assert tier.write_ahead(8 * MIB, 2 * MIB) == 0  # nothing stored yet: an unused tier
    assert tier.mapped == 0 and resident(tier.pool, 0, 32 * MIB) < 0.05
    offset = tier.allocate(3 * MIB + 1)
    assert offset == 0 and tier.high_water == 3 * MIB + 256
    done = [tier.write_ahead(8 * MIB, 2 * MIB) for _ in range(6)]
    assert done == [2 * MIB, 2 * MIB, 2 * MIB, 2 * MIB, 0, 0]
    assert tier.mapped == tier.high_water + 8 * MIB
    assert resident(tier.pool, tier.high_water, tier.mapped) == 1.0
    assert resident(tier.pool, tier.mapped + MIB, 32 * MIB) < 0.1
    # stores into the mapped span move the high water: the reserve follows it
    tier.allocate(4 * MIB)
    assert tier.write_ahead(8 * MIB, 16 * MIB) == 4 * MIB  # past the 4 MiB stored
    assert tier.mapped == tier.high_water + 8 * MIB
    # freed extents are reused first (first fit): the high water stays
    tier.free(0, 3 * MIB + 1)
    assert tier.allocate(MIB) == 0 and tier.write_ahead(8 * MIB, 16 * MIB) == 0


@linux_only
def test_write_ahead_stops_at_the_pool_end_and_a_prefaulted_pool_has_none() -> None:
    tier = DramTier(8 * MIB, 256)
    tier.allocate(6 * MIB)
    assert tier.write_ahead(64 * MIB, 64 * MIB) == 2 * MIB
    assert tier.mapped == 8 * MIB and tier.write_ahead(64 * MIB, 64 * MIB) == 0
    written = DramTier(8 * MIB, 256, prefault=True)
    written.allocate(MIB)
    assert written.mapped == 8 * MIB and written.write_ahead(64 * MIB, 64 * MIB) == 0
    assert tier.write_ahead(0, MIB) == 0 and tier.write_ahead(MIB, 0) == 0


@linux_only
def test_a_shard_writes_ahead_as_configured(make_shard) -> None:
    reserve = 64 * NBYTES
    shard = make_shard(dram_capacity_bytes=4 * MIB, dram_write_ahead_bytes=reserve)
    assert shard.dram_marks() == (0, 0) and shard.write_ahead() == 0
    ks = keys(2)
    shard.put(ks[0], value(0))
    high, _ = shard.dram_marks()
    assert high == NBYTES
    assert shard.write_ahead(chunk=16 * NBYTES) == 16 * NBYTES
    while shard.write_ahead(chunk=16 * NBYTES):
        pass
    assert shard.dram_marks() == (NBYTES, NBYTES + reserve)
    shard.put(ks[1], value(1))  # a store into the mapped span keeps its bytes
    out = np.zeros(NBYTES, dtype=np.uint8)
    assert shard.get_into(ks[1], out) is not None and (out == value(1)).all()
    shard.close()
    assert shard.write_ahead() == 0  # closed: nothing

    off = make_shard(dram_capacity_bytes=4 * MIB)  # the kvdb default: never
    off.put(ks[0], value(0))
    assert off.write_ahead() == 0 and off.dram_marks() == (NBYTES, 0)


def test_the_reserve_is_checked() -> None:
    with pytest.raises(ValueError, match="dram_write_ahead_bytes must be an int >= 0"):
        StoreConfig(engine="memory", dram_write_ahead_bytes=-1)
    with pytest.raises(ValueError, match="dram_write_ahead_bytes must be an int >= 0"):
        StoreConfig(engine="memory", dram_write_ahead_bytes=True)  # type: ignore[arg-type]
    assert StoreConfig(engine="memory").dram_write_ahead_bytes == 0
