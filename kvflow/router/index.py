"""Which prefill instance holds which blocks: the :class:`PrefixIndex` protocol.

Block keys are opaque ``bytes`` here (kvdb's ``BlockKey`` values, or trace hash ids encoded by
:mod:`.trace`). The embedded server implements the protocol over each instance's kvdb shard
(``match_prefix``), a cluster over the replicated metadata view; :class:`LocalPrefixIndex` is the
in-memory reference implementation used by the simulator and the tests.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class PrefixIndex(Protocol):
    """Read-only prefix lookup. Implementations must be safe to call from several threads."""

    def match(self, instance_id: str, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` held by ``instance_id`` (0 for an unknown instance or
        empty ``keys``). Must not change what is held (no recency update)."""
        ...


class LocalPrefixIndex:
    """Instance id -> an LRU set of block keys, with an optional capacity in blocks per instance.

    ``insert`` is the only mutation that refreshes recency. Keys of one request are inserted
    last-to-first, so a prefix's parent is always more recent than its child and LRU drops a child
    before its parent (a child without its parent is unreachable; see DESIGN's eviction rule).
    Thread-safe (one lock).
    """

    def __init__(self, capacity_blocks: int | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 or None, got {capacity_blocks}")
        self._capacity = capacity_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}
        self._evicted = 0
        self._lock = threading.Lock()

    @property
    def capacity_blocks(self) -> int | None:
        return self._capacity

    def match(self, instance_id: str, keys: Sequence[bytes]) -> int:
        with self._lock:
            held = self._blocks.get(instance_id)
            if held is None:
                return 0
            count = 0
            for key in keys:
                if key not in held:
                    break
                count += 1
            return count

    def insert(self, instance_id: str, keys: Sequence[bytes]) -> int:
        """Record that ``instance_id`` holds ``keys`` (a prefix chain) and refresh their recency.

        Returns the number of blocks evicted to stay within capacity. If ``keys`` alone exceed
        the capacity, only its leading ``capacity`` blocks are kept (the useful part of a chain).
        """
        chain = list(keys)
        if self._capacity is not None:
            chain = chain[: self._capacity]
        with self._lock:
            held = self._blocks.setdefault(instance_id, OrderedDict())
            for key in reversed(chain):
                held[key] = None
                held.move_to_end(key)
            evicted = 0
            while self._capacity is not None and len(held) > self._capacity:
                held.popitem(last=False)
                evicted += 1
            self._evicted += evicted
            return evicted

    def remove(self, instance_id: str, keys: Iterable[bytes]) -> None:
        """Forget ``keys`` on ``instance_id`` (absent keys are ignored)."""
        with self._lock:
            held = self._blocks.get(instance_id)
            if held is None:
                return
            for key in keys:
                held.pop(key, None)

    def size(self, instance_id: str) -> int:
        with self._lock:
            return len(self._blocks.get(instance_id, ()))

    @property
    def evicted_blocks(self) -> int:
        """Total blocks evicted by capacity since creation."""
        with self._lock:
            return self._evicted
