"""LeaseTable: ids, release, expiry by deadline (hand-driven clock), drain."""

from __future__ import annotations

from kvflow.kvdb.keys import BlockKey
from kvflow.kvdb.remote.leases import LeaseTable

K = tuple(BlockKey(bytes([i]) * 16) for i in range(4))


def test_grant_release_expire_in_deadline_order() -> None:
    table = LeaseTable()
    a = table.grant("s", K[:2], now=10.0, timeout_s=5.0)
    b = table.grant("s", K[2:], now=11.0, timeout_s=1.0)
    c = table.grant("t", K[:1], now=12.0, timeout_s=5.0)
    assert (a.lease_id, b.lease_id, c.lease_id) == (1, 2, 3)
    assert (a.expires_at, b.expires_at) == (15.0, 12.0) and len(table) == 3
    assert table.next_deadline() == 12.0
    assert table.expire(11.99) == []
    assert [lease.lease_id for lease in table.expire(15.0)] == [2, 1]
    assert table.release(1) is None and table.release(2) is None  # already expired
    assert table.next_deadline() == 17.0
    assert table.release(3) == c and table.next_deadline() is None
    assert (table.granted, table.released, table.expired) == (3, 1, 2)


def test_drain_and_ids_not_reused() -> None:
    table = LeaseTable()
    table.grant("s", K, 0.0, 1.0)
    assert [lease.keys for lease in table.drain()] == [K]
    assert len(table) == 0 and table.expire(100.0) == []
    assert table.grant("s", K, 0.0, 1.0).lease_id == 2
