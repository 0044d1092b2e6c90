"""Every block records its owner tenant: set by the put (the client's namespace), kept through
demotion, a restart and a copy, and used to filter hot blocks and usage."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.kvdb import DEFAULT_TENANT, EmbeddedClient, Namespace, Shard, Tier
from tests.kvdb.conftest import LAYOUT, NAMESPACE, NBYTES, ShardFactory, config, keys, value

BOB = Namespace("tenant-b", NAMESPACE.model_fingerprint, LAYOUT)


def test_a_client_put_records_its_namespace_tenant(make_shard: ShardFactory) -> None:
    shard = make_shard()
    a, b = EmbeddedClient(shard, NAMESPACE), EmbeddedClient(shard, BOB)
    ka, kb = keys(2, "tenant-a"), keys(2, "tenant-b")
    a.batch_put(ka, [value(0), value(1)])
    b.batch_put(kb, [value(2), value(3)])
    shard.put(keys(3, "x")[2], value(4))  # a bare shard put: the default tenant
    assert [shard.info(k).tenant for k in ka + kb] == ["tenant-a"] * 2 + ["tenant-b"] * 2
    assert shard.info(keys(3, "x")[2]).tenant == DEFAULT_TENANT
    info = shard.info(ka[1])
    assert info.parent == ka[0] and info.nbytes == NBYTES and info.tier is Tier.DRAM
    assert shard.info(keys(4, "nobody")[3]) is None


def test_hot_and_usage_filter_by_tenant(make_shard: ShardFactory) -> None:
    shard = make_shard()
    ka, kb = keys(3, "tenant-a"), keys(2, "tenant-b")
    for i, k in enumerate(ka):
        shard.put(k, value(i), tenant="tenant-a")
    for i, k in enumerate(kb):
        shard.put(k, value(10 + i), tenant="tenant-b")
    buf = bytearray(NBYTES)
    for k in (ka[0], ka[0], ka[1], kb[0], kb[0], kb[0]):
        assert shard.get_into(k, buf) is Tier.DRAM
    assert [b.key for b in shard.hot(10)] == [kb[0], ka[0], ka[1]]
    assert [(b.key, b.tenant) for b in shard.hot(10, "tenant-a")] == [
        (ka[0], "tenant-a"),
        (ka[1], "tenant-a"),
    ]
    assert shard.hot(10, "tenant-c") == []
    usage = shard.tenant_usage("tenant-a")
    assert (usage.blocks, usage.dram_blocks, usage.ssd_blocks) == (3, 3, 0)
    assert (usage.nbytes, usage.hits) == (3 * NBYTES, 3)
    assert shard.tenant_usage("tenant-b").hits == 3
    assert shard.tenant_usage("tenant-c").blocks == 0


def test_a_malformed_tenant_is_refused_naming_it(make_shard: ShardFactory) -> None:
    shard = make_shard()
    with pytest.raises(ValueError, match="tenant must be"):
        shard.put(keys(1)[0], value(0), tenant="a b")
    assert not shard.exists(keys(1)[0])


@pytest.mark.parametrize("engine", ["rocksdb", "lmdb"])
def test_the_owner_survives_demotion_and_a_reopen(tmp_path: Path, engine: str) -> None:
    """DRAM blocks demoted by pressure, blocks put straight to SSD and blocks flushed at close
    all come back with their owner."""
    cfg = config(tmp_path, engine=engine, dram_capacity_bytes=4 * NBYTES)
    ka, kb = keys(6, "tenant-a"), keys(3, "tenant-b")
    with Shard(cfg, NAMESPACE.fingerprint()) as shard:
        for i, k in enumerate(ka):
            shard.put(k, value(i), ka[i - 1] if i else None, tenant="tenant-a")
        for i, k in enumerate(kb):
            shard.put(k, value(20 + i), kb[i - 1] if i else None, tenant="tenant-b")
        assert shard.stats().dram.demotions > 0
    with Shard(cfg, NAMESPACE.fingerprint()) as reopened:
        assert [reopened.info(k).tenant for k in ka] == ["tenant-a"] * 6
        assert [reopened.info(k).tenant for k in kb] == ["tenant-b"] * 3
        assert reopened.info(kb[1]).parent == kb[0]
        assert reopened.tenant_usage("tenant-b").ssd_blocks == 3
        assert reopened.get(ka[5]) == value(5).tobytes()
