"""Restart re-adoption with each persistent engine, and the metadata group's record of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvflow.kvdb import NodeId, Shard, Tier, open_store
from kvflow.replication import MetadataConfig
from tests.conftest import pick_free_port
from tests.kvdb.conftest import NAMESPACE, NBYTES, StoreFactory, config, keys, value

FAST_RAFT = {
    "append_entries_period_s": 0.05,
    "raft_min_timeout_s": 0.25,
    "raft_max_timeout_s": 0.6,
    "connection_retry_s": 0.2,
}


def meta_config(tmp_path: Path) -> MetadataConfig:
    return MetadataConfig(
        self_address=f"127.0.0.1:{pick_free_port()}",
        journal_dir=tmp_path / "meta",
        **FAST_RAFT,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("engine", ["rocksdb", "lmdb"])
@pytest.mark.parametrize("flush", [True, False])
def test_restart_readopts_ssd_tier(tmp_path: Path, engine: str, flush: bool) -> None:
    cfg = config(tmp_path, engine=engine, flush_on_close=flush, compression="zstd")
    ks = keys(12)
    shard = Shard(cfg, NAMESPACE.fingerprint(), shuffle_bytes=2)
    for i, key in enumerate(ks):
        shard.put(key, value(i), ks[i - 1] if i else None)
    on_ssd = {k for k in ks if shard.tier_of(k) is Tier.SSD}
    assert len(on_ssd) == 6  # 12 puts into 8 DRAM slots: two demotion rounds of 3
    shard.close()

    shard = Shard(cfg, NAMESPACE.fingerprint(), shuffle_bytes=2)
    try:
        expected = set(ks) if flush else on_ssd
        assert {k for k in ks if shard.exists(k)} == expected
        for i, key in enumerate(ks):
            if key in expected:
                assert shard.tier_of(key) is Tier.SSD
                assert shard.get(key) == value(i).tobytes()
        # parents survive the restart: eviction still goes child-first
        entry = shard._state.index[ks[5]]
        assert entry.parent == ks[4]
    finally:
        shard.close()


def test_store_registers_blocks_in_metadata_and_readopts(
    tmp_path: Path, make_store: StoreFactory
) -> None:
    cfg = config(tmp_path, engine="rocksdb", metadata_flush_interval_s=600.0)
    ks = keys(10)
    node = NodeId("local")
    store = open_store(cfg, NAMESPACE, metadata=meta_config(tmp_path))
    try:
        client = store.client()
        before = store.metadata.view().commands_applied()  # type: ignore[union-attr]
        client.batch_put(ks, [value(i) for i in range(10)])
        assert store.flush_metadata() == 10  # the flusher's period is long: we flush here
        assert store.flush_metadata() == 0
        view = store.metadata.view()  # type: ignore[union-attr]
        assert view.commands_applied() - before == 1
        assert view.blocks_on(node) == 10
        assert view.replicas(ks[9]) == {node: Tier.DRAM}
        assert view.replicas(ks[7]) == {node: Tier.SSD}  # demoted (the chain's leaf first)
        client.change_replica(ks[0], 3)
        assert view.replica_target(ks[0]) == 3
    finally:
        store.close()

    # restart on the same data dir and journal: the metadata is restored and re-adopted
    store = make_store(cfg, metadata=meta_config(tmp_path))
    view = store.metadata.view()  # type: ignore[union-attr]
    assert view.blocks_on(node) == 10
    assert all(view.replicas(k) == {node: Tier.SSD} for k in ks)  # flushed to SSD on close
    buf = np.empty(NBYTES, np.uint8)
    assert store.client().get_into(ks[3], buf) is Tier.SSD
    assert np.array_equal(buf, value(3))


def test_an_lmdb_tier_reopened_with_less_capacity_is_trimmed_not_refused(tmp_path: Path) -> None:
    """LMDB would map only the pages the file holds: the deletes that trim the tier to its new
    capacity then found no free page (MDB_MAP_FULL) and the shard did not open."""
    big = config(tmp_path, engine="lmdb", dram_capacity_bytes=0, ssd_capacity_bytes=96 << 20)
    shard = Shard(big, NAMESPACE.fingerprint())
    ks = keys(80)
    for i, key in enumerate(ks):
        shard.put(key, np.full(1 << 20, i, np.uint8))
    shard.close()
    small = config(tmp_path, engine="lmdb", dram_capacity_bytes=0, ssd_capacity_bytes=8 << 20)
    shard = Shard(small, NAMESPACE.fingerprint())
    try:
        held = [k for k in ks if shard.exists(k)]
        assert 0 < len(held) <= 8
        i = ks.index(held[-1])
        assert shard.get(held[-1]) == bytes([i]) * (1 << 20)
    finally:
        shard.close()
