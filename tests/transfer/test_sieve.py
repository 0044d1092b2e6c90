from __future__ import annotations

import pytest

from kvflow.transfer.sieve import SieveQueue


def test_eviction_order_is_exactly_sieve() -> None:
    queue: SieveQueue[str] = SieveQueue(3)
    for key in "abc":
        assert queue.insert(key) is None
    queue.touch("a")
    # hand starts at the tail: a is visited (cleared, skipped), b is evicted
    assert queue.insert("d") == "b"
    assert queue.order() == ["a", "c", "d"]
    # hand stayed where b was, now c: not visited, evicted
    assert queue.insert("e") == "c"
    assert queue.order() == ["a", "d", "e"]
    queue.touch("d")
    queue.touch("e")
    # hand at d: d and e are visited and cleared, the hand wraps to a (cleared earlier)
    assert queue.insert("f") == "a"
    assert queue.order() == ["d", "e", "f"]
    # d lost its visited bit in the last sweep
    assert queue.insert("g") == "d"
    assert queue.order() == ["e", "f", "g"]


def test_hits_do_not_move_keys_and_new_keys_enter_at_head() -> None:
    queue: SieveQueue[int] = SieveQueue(4)
    for key in range(4):
        queue.insert(key)
    queue.touch(0)
    queue.touch(2)
    assert queue.order() == [0, 1, 2, 3]
    assert queue.evict() == 1
    assert queue.evict() == 3  # 2 is visited: cleared and skipped
    assert queue.evict() == 0  # wrapped: 0 was cleared on the first sweep
    assert queue.order() == [2]


def test_remove_keeps_the_hand_consistent() -> None:
    queue: SieveQueue[str] = SieveQueue(3)
    for key in "abc":
        queue.insert(key)
    queue.touch("a")
    assert queue.evict() == "b"  # hand now at c (index 1)
    queue.remove("a")  # index 0 < hand: hand shifts to stay on c
    queue.insert("x")
    assert queue.evict() == "c"
    assert queue.order() == ["x"]
    queue.remove("missing")  # no-op


def test_bad_use_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SieveQueue(0)
    queue: SieveQueue[str] = SieveQueue(2)
    with pytest.raises(IndexError):
        queue.evict()
    queue.insert("a")
    with pytest.raises(ValueError, match="already"):
        queue.insert("a")
    with pytest.raises(KeyError):
        queue.touch("zz")
