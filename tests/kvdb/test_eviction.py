"""Victim selection: exact orders for each policy."""

from __future__ import annotations

from kvflow.kvdb.eviction import (
    Candidate,
    EvictAction,
    LRUPolicy,
    PrefixReplicaLRUPolicy,
    TierBlock,
    select_victims,
)
from kvflow.kvdb.keys import BlockKey


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(16, b"."))


def blocks(spec: list[tuple[str, str | None, int, int, bool]]) -> dict[BlockKey, TierBlock]:
    """(name, parent, last_access, replicas, evictable); each block 10 bytes."""
    children: dict[str, int] = {}
    for _, parent, *_ in spec:
        if parent is not None:
            children[parent] = children.get(parent, 0) + 1
    return {
        k(name): TierBlock(
            candidate=Candidate(k(name), access, replicas, 10),
            parent=None if parent is None else k(parent),
            evictable=evictable,
            blocking_children=children.get(name, 0),
        )
        for name, parent, access, replicas, evictable in spec
    }


# a chain a <- b <- c (c is the leaf), plus a lone block x; a is the OLDEST access
CHAIN = [
    ("a", None, 1, 1, True),
    ("b", "a", 5, 1, True),
    ("c", "b", 6, 1, True),
    ("x", None, 3, 1, True),
]


def names(victims: list[BlockKey]) -> list[str]:
    return [v.rstrip(b".").decode() for v in victims]


def test_lru_ignores_prefixes() -> None:
    assert names(select_victims(blocks(CHAIN), 40, LRUPolicy())) == ["a", "x", "b", "c"]
    assert names(select_victims(blocks(CHAIN), 15, LRUPolicy())) == ["a", "x"]


def test_prefix_policy_evicts_child_before_parent() -> None:
    order = select_victims(blocks(CHAIN), 40, PrefixReplicaLRUPolicy())
    assert names(order) == ["x", "c", "b", "a"]


def test_blocks_with_replicas_elsewhere_go_first() -> None:
    spec = [
        ("a", None, 1, 1, True),
        ("b", None, 2, 3, True),
        ("c", None, 3, 2, True),
        ("d", None, 4, 1, True),
    ]
    assert names(select_victims(blocks(spec), 40, PrefixReplicaLRUPolicy())) == ["b", "c", "a", "d"]


def test_pinned_blocks_are_never_chosen() -> None:
    spec = [("a", None, 1, 1, False), ("b", None, 2, 1, True), ("c", "b", 3, 1, False)]
    assert names(select_victims(blocks(spec), 100, LRUPolicy())) == ["b"]
    # prefix policy: b has a pinned child -> only reachable through the fallback
    assert names(select_victims(blocks(spec), 100, PrefixReplicaLRUPolicy())) == ["b"]
    assert select_victims(blocks(spec), 0, PrefixReplicaLRUPolicy()) == []


def test_cycle_falls_back_to_priority_order() -> None:
    spec = [("a", "b", 1, 1, True), ("b", "a", 2, 1, True)]
    assert names(select_victims(blocks(spec), 20, PrefixReplicaLRUPolicy())) == ["a", "b"]


def test_actions() -> None:
    last = Candidate(k("a"), 1, 1, 10)
    shared = Candidate(k("b"), 1, 2, 10)
    policy = PrefixReplicaLRUPolicy()
    assert policy.action(last, can_demote=True) is EvictAction.DEMOTE
    assert policy.action(shared, can_demote=True) is EvictAction.DROP
    assert policy.action(last, can_demote=False) is EvictAction.DROP
    assert LRUPolicy().action(shared, can_demote=True) is EvictAction.DEMOTE
