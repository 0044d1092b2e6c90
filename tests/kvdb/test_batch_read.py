"""Shard.get_many_into: one batch read over DRAM and SSD hits, misses, buffers of the wrong
size and corrupted blocks, answering per key as get_into would; a large batch is copied on two
threads (kvdb/copier.py) and lands byte for byte."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvflow.kvdb import Tier, ValueSizeError, copier
from kvflow.kvdb import shard as shard_module
from tests.kvdb.conftest import NBYTES, ShardFactory, keys, value


def test_a_batch_answers_each_key_as_get_into_would(make_shard: ShardFactory) -> None:
    shard = make_shard()
    ks = keys(7)
    for i, k in enumerate(ks[:6]):
        shard.put(k, value(i))
    shard.evict(Tier.DRAM, 2 * NBYTES)  # the oldest go to SSD
    tiers = [shard.tier_of(k) for k in ks[:6]]
    assert Tier.SSD in tiers[:4] and Tier.DRAM in tiers[:4] and tiers[5] is Tier.DRAM
    entry = shard._state.index[ks[5]]
    assert shard._state.dram is not None and entry.dram is not None
    shard._state.dram.pool[entry.dram + 3] ^= 0xFF  # block 5 goes bad in DRAM
    bufs = [np.zeros(NBYTES, np.uint8) for _ in range(7)]
    bufs[4] = np.full(NBYTES // 2, 7, np.uint8)  # the wrong size: nothing written
    got = shard.get_many_into(ks, bufs)
    assert got[:4] == tiers[:4]
    assert got[4] == NBYTES and (bufs[4] == 7).all()
    assert got[5] is None and not shard.exists(ks[5])  # corrupt: a counted miss, removed
    assert got[6] is None  # never stored
    for i in range(4):
        assert bufs[i].tobytes() == value(i).tobytes()
    stats = shard.stats()
    assert stats.dram.corruptions == 1
    assert shard.get_many_into([], []) == []
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        shard.get_many_into(ks[:2], bufs[:1])
    with pytest.raises(ValueSizeError):
        shard.get_into(ks[0], bufs[4])  # the single read still raises


def test_a_large_batch_is_copied_on_two_threads(
    make_shard: ShardFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(copier, "SPLIT_BYTES", 4 * NBYTES)
    shard = make_shard(dram_capacity_bytes=16 * NBYTES, verify_dram_hits=False)
    ks = keys(16)
    for i, k in enumerate(ks):
        shard.put(k, value(i))
    seen: set[str] = set()
    real = shard_module._copy

    def spy(dst: np.ndarray, src: np.ndarray) -> bool:
        seen.add(threading.current_thread().name)
        return real(dst, src)

    monkeypatch.setattr(shard_module, "_copy", spy)
    bufs = [np.zeros(NBYTES, np.uint8) for _ in ks]
    assert shard.get_many_into(ks, bufs) == [Tier.DRAM] * 16
    assert all(b.tobytes() == value(i).tobytes() for i, b in enumerate(bufs))
    assert len(seen) == 2 and any(name.startswith("kvdb-copy") for name in seen)
    assert all(shard._state.index[k].readers == 0 for k in ks)  # every pin let go


def test_run_all_keeps_order_and_waits_for_both_halves() -> None:
    out = copier.run_all([lambda i=i: i % 2 == 0 for i in range(9)], [1 << 20] * 9)
    assert out == [i % 2 == 0 for i in range(9)]
    assert copier.run_all([], []) == []

    def boom() -> bool:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        copier.run_all([boom, lambda: True], [4 << 20, 4 << 20])
