"""The client API: match_prefix, batch forms, buffer kinds, events, stats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.kvdb import BlockRemoved, BlockStored, EmbeddedClient, KVDBError, Namespace, Tier
from tests.kvdb.conftest import LAYOUT, NAMESPACE, NBYTES, ShardFactory, keys, value


@pytest.fixture
def client(make_shard: ShardFactory) -> EmbeddedClient:
    return EmbeddedClient(make_shard(eviction="lru"), NAMESPACE)


def test_match_prefix_semantics(client: EmbeddedClient) -> None:
    ks = keys(6)
    assert client.match_prefix([]) == 0
    assert client.match_prefix(ks) == 0
    client.batch_put(ks[:4], [value(i) for i in range(4)])
    assert client.match_prefix(ks) == 4
    assert client.match_prefix(ks[:2]) == 2
    client.remove(ks[1])
    assert client.match_prefix(ks) == 1  # stops at the first hole, even if later keys exist
    assert client.batch_exists(ks) == [True, False, True, True, False, False]
    client.put(ks[1], value(1))
    # blocks in SSD count too
    client.batch_put(ks[4:], [value(4), value(5)])
    for i in range(6, 12):
        client.put(keys(12)[i], value(i))
    assert client.shard.tier_of(ks[0]) is Tier.SSD
    assert client.match_prefix(ks) == 6


def test_batch_forms(client: EmbeddedClient) -> None:
    ks = keys(4)
    assert client.batch_put(ks, [value(i) for i in range(4)]) == [Tier.DRAM] * 4
    bufs = [np.empty(NBYTES, np.uint8) for _ in range(5)]
    missing = keys(1, "tenant-b")[0]
    assert client.batch_get_into([*ks, missing], bufs) == [Tier.DRAM] * 4 + [None]
    assert all(np.array_equal(bufs[i], value(i)) for i in range(4))
    assert client.batch_get([ks[0], missing]) == [value(0).tobytes(), None]
    assert client.batch_remove([ks[0], missing]) == [True, False]
    assert client.batch_put([], []) == []
    assert client.batch_get_into([], []) == [] and client.match_prefix([]) == 0
    with pytest.raises(ValueError, match="values"):
        client.batch_put(ks, [value(0)])
    with pytest.raises(ValueError, match="buffers"):
        client.batch_get_into(ks, bufs[:1])


def test_batch_put_records_chain_parents(client: EmbeddedClient) -> None:
    ks = keys(3)
    client.batch_put(ks, [value(i) for i in range(3)])
    parents = [e.parent for e in client.take_events() if isinstance(e, BlockStored)]
    assert parents == [None, ks[0], ks[1]]
    other = keys(2, "tenant-b")
    client.batch_put(other, [value(0), value(1)], parents=[ks[2], None])
    parents = [e.parent for e in client.take_events() if isinstance(e, BlockStored)]
    assert parents == [ks[2], None]


def test_buffer_kinds(client: EmbeddedClient) -> None:
    key = keys(1)[0]
    tensor = torch.randn(LAYOUT.shape, dtype=torch.float32).to(torch.bfloat16)
    assert client.put(key, tensor) is Tier.DRAM
    out = torch.empty(LAYOUT.shape, dtype=torch.bfloat16)
    assert client.get_into(key, out) is Tier.DRAM
    assert torch.equal(out, tensor)
    mv = memoryview(bytearray(NBYTES))
    assert client.get_into(key, mv) is Tier.DRAM
    assert bytes(mv) == tensor.view(torch.uint8).numpy().tobytes()
    arr16 = np.empty(NBYTES // 2, np.uint16)
    assert client.get_into(key, arr16) is Tier.DRAM
    assert arr16.tobytes() == bytes(mv)
    with pytest.raises(KVDBError, match="contiguous"):
        client.get_into(key, torch.empty(LAYOUT.shape, dtype=torch.bfloat16).transpose(0, 4))


def test_events_and_stats(client: EmbeddedClient) -> None:
    ks = keys(2)
    client.put(ks[0], value(0))
    client.remove(ks[0])
    assert client.take_events() == [
        BlockStored(ks[0], Tier.DRAM, NBYTES, None),
        BlockRemoved(ks[0]),
    ]
    assert client.take_events() == []
    client.put(ks[1], value(1))
    buf = np.empty(NBYTES, np.uint8)
    client.get_into(ks[1], buf)
    client.get_into(ks[0], buf)
    stats = client.stats()
    assert (stats.dram.hits, stats.dram.misses, stats.ssd.misses) == (1, 1, 1)
    assert stats.dram.bytes_read == NBYTES and stats.dram.hit_rate == 0.5
    assert client.shard.stats(reset=True).puts == 2
    assert client.stats().dram.hits == 0 and client.stats().dram.blocks == 1


def test_tenants_share_a_shard_without_sharing_blocks(client: EmbeddedClient) -> None:
    other = EmbeddedClient(client.shard, Namespace("tenant-b", NAMESPACE.model_fingerprint, LAYOUT))
    client.put(keys(1)[0], value(0))
    assert other.match_prefix(keys(1, "tenant-b")) == 0


def test_change_replica_needs_metadata(client: EmbeddedClient) -> None:
    with pytest.raises(KVDBError, match="metadata"):
        client.change_replica(keys(1)[0], 2)
