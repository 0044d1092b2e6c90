"""runtime.PinBook over a real shard: pins with a TTL, extended by a second pin, dropped when
the TTL lapses (then the blocks are evictable again)."""

from __future__ import annotations

import pytest

from kvflow.kvdb import Tier
from kvflow.stages.runtime.pins import PinBook
from tests.kvdb.conftest import ShardFactory, keys, make_shard, value  # noqa: F401 - the fixture


def test_pins_last_until_their_ttl_and_a_second_pin_extends_it(
    make_shard: ShardFactory,  # noqa: F811 - the fixture
) -> None:
    shard = make_shard()
    ks = keys(4)
    for i, k in enumerate(ks[:3]):
        shard.put(k, value(i))
    book = PinBook(shard)
    assert book.pin(ks, ttl_s=10.0, now=100.0) == 3  # the 4th is not held
    assert shard.num_pinned() == 3 and len(book) == 3
    assert book.pin(ks[:1], ttl_s=20.0, now=105.0) == 1  # extended to 125, not a 2nd pin
    assert shard.num_pinned() == 3
    shard.evict(Tier.DRAM, 1 << 30)
    assert all(shard.tier_of(k) is Tier.DRAM for k in ks[:3])
    assert book.reap(now=109.9) == 0
    assert book.reap(now=110.0) == 2 and shard.num_pinned() == 1
    assert book.reap(now=125.0) == 1 and shard.num_pinned() == 0
    shard.evict(Tier.DRAM, 1 << 30)
    assert all(shard.tier_of(k) is not Tier.DRAM for k in ks[:3])
    with pytest.raises(ValueError, match="ttl_s"):
        book.pin(ks, ttl_s=0.0, now=1.0)
