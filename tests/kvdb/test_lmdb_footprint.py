"""The SSD tier accounts what LMDB really occupies: overflow values round up to whole pages."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest

from kvflow.kvdb import DEFAULT_TENANT, Shard, codec
from kvflow.kvdb.engines import ENGINES
from tests.kvdb.conftest import NAMESPACE, config, keys, value


def _stat(path: Path) -> dict[str, int]:
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        return dict(env.stat())
    finally:
        env.close()


@pytest.mark.parametrize("size", [100, 1000, 2014, 2015, 4080, 4081, 8177, 100_000])
def test_footprint_matches_lmdbs_own_page_counts(tmp_path: Path, size: int) -> None:
    """LMDB's own statistics after 40 values of ``size`` bytes under 16-byte keys: overflow
    values take exactly the pages footprint() counts; leaf values fill pages at least half."""
    engine = ENGINES["lmdb"].open(tmp_path / "db", 64 << 20)
    n = 40
    engine.put_many([(i.to_bytes(16, "big"), bytes([i]) * size) for i in range(n)])
    each = engine.footprint(16, size)
    engine.close()
    stat = _stat(tmp_path / "db")
    psize = stat["psize"]
    if stat["overflow_pages"]:
        assert stat["overflow_pages"] * psize == n * (each - 34)  # less the leaf node's 34 bytes
    else:
        assert size <= 2014 and each == size + 26
        assert n * each <= stat["leaf_pages"] * psize <= 2 * n * each + psize


def test_an_lmdb_tier_of_small_records_stays_within_its_capacity_on_disk(tmp_path: Path) -> None:
    """Records just over LMDB's leaf limit (2,100 bytes) each take a 4 KiB overflow page: the
    tier counted 2,100 and let the disk hold twice its capacity (and the map fill)."""
    raw = 2100 - codec.HEADER_BYTES - len(DEFAULT_TENANT)
    capacity = 1 << 20
    cfg = config(tmp_path, engine="lmdb", dram_capacity_bytes=0, ssd_capacity_bytes=capacity)
    shard = Shard(cfg, NAMESPACE.fingerprint())
    ks = keys(1200)
    try:
        for i, key in enumerate(ks):
            shard.put(key, value(i, raw))
        held = [k for k in ks if shard.exists(k)]
        assert 200 <= len(held) <= capacity // 4096  # evicted by what the pages hold
        assert shard.get(held[-1]) == value(ks.index(held[-1]), raw).tobytes()
    finally:
        shard.close()
    stat = _stat(tmp_path / "data" / "ssd")
    assert stat["entries"] == len(held)
    assert stat["overflow_pages"] * stat["psize"] <= capacity
