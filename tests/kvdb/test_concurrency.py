"""Concurrent readers and writers on threads: no torn or wrong values, consistent accounting."""

from __future__ import annotations

import contextlib
import itertools
import random
import threading

import numpy as np

from kvflow.kvdb import BlockPinnedError, Shard, Tier
from tests.kvdb.conftest import NBYTES, RECORD, ShardFactory, keys, value

VALUES = [value(i) for i in range(40)]


def check_invariants(shard: Shard) -> None:
    s = shard._state
    assert s.dram is not None and s.ssd is not None
    dram_used = sum(s.dram.rounded(e.nbytes) for e in s.index.values() if e.dram is not None)
    assert s.dram.used == dram_used
    assert set(s.ssd.sizes) == {e.key for e in s.index.values() if e.on_ssd}
    assert set(s.ssd.sizes) == {k for k, _ in s.ssd.engine.scan()}
    assert s.ssd.used == sum(s.ssd.sizes.values())
    offsets = sorted((e.dram, e.nbytes) for e in s.index.values() if e.dram is not None)
    for (a, n), (b, _) in itertools.pairwise(offsets):
        assert a + n <= b  # no two blocks share DRAM


def test_threads_read_write_remove_without_corruption(make_shard: ShardFactory) -> None:
    shard = make_shard(ssd_capacity_bytes=24 * RECORD)
    ks = keys(len(VALUES))
    errors: list[BaseException] = []
    bad: list[int] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        buf = np.empty(NBYTES, np.uint8)
        try:
            for _ in range(500):
                i = rng.randrange(len(ks))
                op = rng.random()
                if op < 0.4:
                    shard.put(ks[i], VALUES[i])
                elif op < 0.82:
                    tier = shard.get_into(ks[i], buf)
                    if tier is not None and not np.array_equal(buf, VALUES[i]):
                        bad.append(i)
                elif op < 0.87:
                    if shard.pin([ks[i]])[0]:
                        shard.unpin([ks[i]])
                else:
                    with contextlib.suppress(BlockPinnedError):  # another thread's pin
                        shard.remove(ks[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == [], errors
    assert bad == [], bad
    check_invariants(shard)
    stats = shard.stats()
    assert stats.dram.corruptions == 0 and stats.ssd.corruptions == 0
    assert stats.dram.demotions > 0 and stats.dram.hits > 0
    for i, key in enumerate(ks):
        got = shard.get(key)
        assert got is None or got == VALUES[i].tobytes()
        assert shard.tier_of(key) in (None, Tier.DRAM, Tier.SSD)
