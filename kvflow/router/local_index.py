"""The in-memory :class:`LocalPrefixIndex`: the simulator's index and the tests' reference.

It implements every protocol of :mod:`.index` (``match``, ``match_all``, ``match_holders``)
over one LRU per instance and a reverse map. Compiled with mypyc where the build can (see the
README), like the rest of the simulator's hot path: keep it typed as mypy checks it.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Sequence
from itertools import islice, takewhile
from typing import TypeAlias

from kvflow.router.index import prefix_lengths, walk_holders

FEW_HOLDERS = 4
"""Up to this many holders of a request's first key, :meth:`LocalPrefixIndex.match_holders`
walks each holder's own keys (a C-level loop per holder); past it, one reverse-map walk."""


_Owners: TypeAlias = str | dict[str, None]
"""How :class:`LocalPrefixIndex` stores a key's holders: the instance id itself while it is the
only holder (most keys: no dict built per new block), else a dict of two or more ids (values
None). Read it through :func:`_holder_ids`."""


def _holder_ids(owners: _Owners | None) -> Collection[str] | None:
    """A stored :data:`_Owners` value as a collection of instance ids (``None`` passes through)."""
    return (owners,) if isinstance(owners, str) else owners


class LocalPrefixIndex:
    """Instance id -> an LRU set of block keys, with an optional capacity in blocks per instance.

    ``insert`` is the only mutation that refreshes recency. Keys of one request are inserted
    last-to-first, so a prefix's parent is always more recent than its child and LRU drops a child
    before its parent (a child without its parent is unreachable; see DESIGN's eviction rule).
    A reverse map (key -> holders) serves :meth:`match_all`. Thread-safe (one lock).
    """

    def __init__(self, capacity_blocks: int | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 or None, got {capacity_blocks}")
        self._capacity = capacity_blocks
        # instance -> its keys, least recent first: a plain dict keeps insertion order, so a
        # refreshed key is deleted and put back last. Not an OrderedDict: a dict of bytes keys
        # and None values is not tracked by the garbage collector (an OrderedDict is, and its
        # collections walked every cached key) and adds a key without a linked-list node
        self._blocks: dict[str, dict[bytes, None]] = {}
        # key -> its holders (:data:`_Owners`). Two or more as dict keys (values None): a dict
        # of strings is not tracked by the garbage collector, a set is (one per cached block
        # made collections cost ~5% of a run)
        self._holders: dict[bytes, _Owners] = {}
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

    def match_all(self, instance_ids: Sequence[str], keys: Sequence[bytes]) -> list[int]:
        """See :class:`BatchPrefixIndex`: one reverse-map lookup per key."""
        with self._lock:
            holders = self._holders
            return walk_holders(instance_ids, (_holder_ids(holders.get(k)) for k in keys))

    def match_holders(self, keys: Sequence[bytes]) -> dict[str, int]:
        """See :class:`HolderPrefixIndex`. Few holders of the first key (the common case under a
        cache-aware policy): each one's prefix is counted over its own keys by a C-level
        ``takewhile``; else one reverse-map lookup per key (:func:`prefix_lengths`)."""
        lock = self._lock
        lock.acquire()  # not ``with``: ~800 fewer instructions a call (callgrind, Python 3.11)
        try:
            first = self._holders.get(keys[0]) if keys else None
            if first is None:
                return {}
            if isinstance(first, str):  # one holder (most keys)
                held = self._blocks[first]
                return {first: len(list(takewhile(held.__contains__, keys)))}
            if len(first) > FEW_HOLDERS:
                return prefix_lengths(map(_holder_ids, map(self._holders.get, keys)))
            blocks = self._blocks
            return {
                instance_id: len(list(takewhile(blocks[instance_id].__contains__, keys)))
                for instance_id in first
            }
        finally:
            lock.release()

    def holders_of(self, key: bytes) -> frozenset[str]:
        """The instances holding ``key`` (empty when none)."""
        with self._lock:
            return frozenset(_holder_ids(self._holders.get(key)) or ())

    def insert(self, instance_id: str, keys: Sequence[bytes]) -> int:
        """Record that ``instance_id`` holds ``keys`` (a prefix chain) and refresh their recency.

        Returns the number of blocks evicted to stay within capacity. If ``keys`` alone exceed
        the capacity, only its leading ``capacity`` blocks are kept (the useful part of a chain).
        """
        capacity = self._capacity
        if capacity is not None and len(keys) > capacity:
            keys = keys[:capacity]
        lock = self._lock
        lock.acquire()  # not ``with`` (see match_holders)
        try:
            held = self._blocks.get(instance_id)
            if held is None:  # not setdefault: that would build a dict per call
                held = self._blocks[instance_id] = {}
            holders = self._holders
            claim = holders.setdefault  # one lookup: stores instance_id where nobody holds key
            take = held.pop  # one lookup for a held key (not ``in`` and ``del``)
            for key in reversed(keys):
                if take(key, True) is None:  # it was held (values are None): back in, last
                    held[key] = None
                else:
                    held[key] = None
                    owners = claim(key, instance_id)
                    if owners is not instance_id:  # already held, by others (key was not in held)
                        if isinstance(owners, str):  # a second holder
                            holders[key] = {owners: None, instance_id: None}
                        else:
                            owners[instance_id] = None
            if capacity is None or len(held) <= capacity:  # usual: no max(), no counter update
                return 0
            evicted = len(held) - capacity
            # the least recent first; one pass (each next(iter(held)) would re-skip the slots
            # of the keys deleted before it, until the dict is next resized)
            for key in list(islice(held, evicted)):
                del held[key]
                self._drop_holder(key, instance_id)
            self._evicted += evicted
            return evicted
        finally:
            lock.release()

    def _drop_holder(self, key: bytes, instance_id: str) -> None:
        """Forget that ``instance_id`` holds ``key`` (its caller just dropped the key from that
        instance's blocks, so it does): the last holder deletes the entry, the second-last one
        is stored as its id again (a dict always has two or more)."""
        holders = self._holders
        owners = holders[key]
        if isinstance(owners, str):  # instance_id itself
            del holders[key]
        else:
            del owners[instance_id]
            if len(owners) == 1:
                holders[key] = next(iter(owners))  # the one left

    def remove(self, instance_id: str, keys: Iterable[bytes]) -> None:
        """Forget ``keys`` on ``instance_id`` (absent keys are ignored)."""
        with self._lock:
            held = self._blocks.get(instance_id)
            if held is None:
                return
            for key in keys:
                if key in held:
                    del held[key]
                    self._drop_holder(key, instance_id)

    def size(self, instance_id: str) -> int:
        with self._lock:
            return len(self._blocks.get(instance_id, ()))

    def num_blocks(self) -> int:
        """Distinct keys held by at least one instance."""
        with self._lock:
            return len(self._holders)

    @property
    def evicted_blocks(self) -> int:
        """Total blocks evicted by capacity since creation."""
        with self._lock:
            return self._evicted
