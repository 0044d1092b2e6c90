"""LocalPrefixIndex: leading matches and LRU that drops children before parents."""

from __future__ import annotations

import pytest

from kvflow.router import LocalPrefixIndex, PrefixIndex
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
