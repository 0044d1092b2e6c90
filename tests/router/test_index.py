"""LocalPrefixIndex: leading matches and LRU that drops children before parents."""

from __future__ import annotations

import random

import pytest

from kvflow.replication import MetadataTable, MetadataView, NodeId, Tier
from kvflow.router import BatchPrefixIndex, LocalPrefixIndex, MetadataPrefixIndex, PrefixIndex
from kvflow.router.index import HolderPrefixIndex, prefix_lengths
from tests.router.conftest import keys


def test_match_counts_leading_keys_only():
    index = LocalPrefixIndex()
    index.insert("a", keys(3))
    assert isinstance(index, PrefixIndex)
    assert index.match("a", keys(5)) == 3
    assert index.match("a", (b"x", *keys(3))) == 0
    assert index.match("b", keys(3)) == 0
    assert index.match("a", ()) == 0
    index.remove("a", [keys(3)[1]])
    assert index.match("a", keys(3)) == 1


def test_lru_evicts_child_before_parent():
    index = LocalPrefixIndex(capacity_blocks=4)
    index.insert("a", keys(3, "x"))
    index.insert("a", keys(2, "y"))  # one block over: x2, the oldest child, goes
    assert index.match("a", keys(3, "x")) == 2
    assert index.evicted_blocks == 1
    index.insert("a", keys(2, "x"))  # refresh x0, x1: y1 then y0 are the oldest
    index.insert("a", keys(1, "z"))
    assert index.match("a", keys(2, "y")) == 1
    assert index.size("a") == 4


def test_chain_longer_than_capacity_keeps_its_head():
    index = LocalPrefixIndex(capacity_blocks=3)
    assert index.insert("a", keys(5)) == 0
    assert index.match("a", keys(5)) == 3


def test_capacity_validated():
    with pytest.raises(ValueError, match="capacity_blocks"):
        LocalPrefixIndex(0)


def test_match_all_equals_match_per_instance():
    rng = random.Random(3)
    index = LocalPrefixIndex(capacity_blocks=30)
    ids = [f"i{n}" for n in range(6)]
    for _ in range(200):
        index.insert(rng.choice(ids), keys(rng.randint(1, 12), rng.choice("ab")))
        if rng.random() < 0.2:
            index.remove(rng.choice(ids), [keys(12, "a")[rng.randrange(12)]])
        probe = keys(rng.randint(0, 14), rng.choice("ab"))
        asked = [*ids, "unknown", ids[0]]  # an unknown instance and a repeat
        assert index.match_all(asked, probe) == [index.match(i, probe) for i in asked]
        every = {i: index.match(i, probe) for i in ids}
        assert index.match_holders(probe) == {i: n for i, n in every.items() if n > 0}
    assert isinstance(index, BatchPrefixIndex) and isinstance(index, HolderPrefixIndex)


def test_a_key_keeps_every_holder_as_holders_come_and_go():
    """A key's holders are stored as one id or a dict of several: every reader must see each
    holder through the second one arriving, removals, eviction and a holder coming back."""
    index = LocalPrefixIndex(capacity_blocks=3)
    k = keys(3)
    index.insert("a", k[:1])
    assert index.holders_of(k[0]) == {"a"} and index.num_blocks() == 1
    index.insert("b", k[:2])  # k0 gets a second holder
    assert index.holders_of(k[0]) == {"a", "b"} and index.holders_of(k[1]) == {"b"}
    assert index.num_blocks() == 2
    assert index.match_holders(k) == {"a": 1, "b": 2}
    assert index.match_all(["a", "b", "c"], k) == [1, 2, 0]
    index.insert("c", k[:1])  # and a third
    assert index.holders_of(k[0]) == {"a", "b", "c"}
    index.remove("b", k[:1])
    assert index.holders_of(k[0]) == {"a", "c"} and index.holders_of(k[1]) == {"b"}
    assert index.match_holders(k) == {"a": 1, "c": 1}
    index.remove("a", k[:1])  # one holder left
    index.remove("x", k[:1])  # an unknown instance: nothing changes
    assert index.holders_of(k[0]) == {"c"} and index.num_blocks() == 2
    assert index.match_holders(k) == {"c": 1}
    assert index.match_all(["a", "c"], k) == [0, 1]
    index.insert("a", k[:1])  # a second holder again
    assert index.holders_of(k[0]) == {"a", "c"}
    assert index.insert("a", keys(3, "x")) == 1  # evicts a's k0, its oldest block
    assert index.holders_of(k[0]) == {"c"} and index.match_holders(k) == {"c": 1}
    index.insert("b", k[:1])
    index.remove("c", k)
    assert index.holders_of(k[0]) == {"b"} and index.match_holders(k) == {"b": 2}
    index.remove("b", k)
    assert index.holders_of(k[0]) == frozenset() and index.match_holders(k) == {}
    assert index.num_blocks() == 3  # a's x0..x2


def test_holders_and_block_count_agree_with_each_instance_blocks():
    """Random inserts (past capacity), removals and probes: ``holders_of`` and ``num_blocks``
    must equal what each instance's own blocks say, whatever a key's holder count went through."""
    rng = random.Random(7)
    index = LocalPrefixIndex(capacity_blocks=10)
    ids = [f"i{n}" for n in range(7)]  # more than FEW_HOLDERS: both match_holders paths
    universe = [*keys(8, "a"), *keys(8, "b")]
    for _ in range(400):
        instance_id = rng.choice(ids)
        if rng.random() < 0.3:
            index.remove(instance_id, rng.sample(universe, 3))
        else:
            index.insert(instance_id, keys(rng.randint(1, 8), rng.choice("ab")))
        holders = {k: {i for i in ids if index.match(i, (k,)) == 1} for k in universe}
        assert {k: index.holders_of(k) for k in universe} == holders
        assert index.num_blocks() == sum(1 for owners in holders.values() if owners)
        probe = keys(rng.randint(1, 9), rng.choice("ab"))
        every = {i: index.match(i, probe) for i in ids}
        assert index.match_holders(probe) == {i: n for i, n in every.items() if n > 0}
        assert index.match_all(ids, probe) == list(every.values())


def test_prefix_lengths_stops_at_the_first_key_nobody_left_holds():
    read: list[int] = []

    def holder_sets():  # type: ignore[no-untyped-def]
        for n, holders in enumerate([{"a", "b", "c"}, {"a", "b"}, ["b"], {"a"}, None, {"b"}]):
            read.append(n)
            yield holders

    assert prefix_lengths(holder_sets()) == {"c": 1, "a": 2, "b": 3}
    assert read == [0, 1, 2, 3]  # the 4th key: "b" alone was matching and does not hold it
    assert prefix_lengths([{"a"}, {"a"}, {"a"}]) == {"a": 3}
    assert prefix_lengths([None, {"a"}]) == {} == prefix_lengths([]) == prefix_lengths([set()])
    assert prefix_lengths([{"a", "b"}, {"a", "b"}]) == {"a": 2, "b": 2}


def test_metadata_index_reads_holders_once_per_request():
    table = MetadataTable()
    table.record_batch(NodeId("p0"), [(k, Tier.DRAM) for k in keys(4)], (), 0.0)
    table.record_batch(NodeId("p1"), [(k, Tier.SSD) for k in keys(2)], (), 0.0)
    view = MetadataView.of_table(table)
    calls: list[int] = []

    class Counting:
        def holders(self, ks):  # type: ignore[no-untyped-def]
            calls.append(len(ks))
            return view.holders(ks)

    index = MetadataPrefixIndex(Counting())  # type: ignore[arg-type]
    assert index.match_all(["p0", "p1", "p2"], keys(5)) == [4, 2, 0]
    assert calls == [5]
    assert index.match("p1", keys(5)) == 2
    assert index.match_all(["p0"], ()) == [0]
    assert calls == [5, 5]
    assert index.match_holders(keys(5)) == {"p0": 4, "p1": 2}
    assert index.match_holders(()) == {}
    assert calls == [5, 5, 5]
