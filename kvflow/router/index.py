"""Which prefill instance holds which blocks: the :class:`PrefixIndex` protocol.

Block keys are opaque ``bytes`` here (kvdb's ``BlockKey`` values, or trace hash ids encoded by
:mod:`.trace`). The embedded server implements the protocol over each instance's kvdb shard
(``match_prefix``), a cluster over the replicated metadata view (:mod:`.metadata_index`);
:class:`LocalPrefixIndex` is the in-memory reference implementation used by the simulator and the
tests.

An index that can answer for every instance at once implements :class:`BatchPrefixIndex`
(``match_all``): the conductor then reads each key's holders once per request instead of once
per instance (the difference between ~1 ms and ~20 ms per decision at 64 instances).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Sequence
from itertools import islice, takewhile
from typing import Protocol, TypeAlias, runtime_checkable

FEW_HOLDERS = 4
"""Up to this many holders of a request's first key, :meth:`LocalPrefixIndex.match_holders`
walks each holder's own keys (a C-level loop per holder); past it, one reverse-map walk."""


@runtime_checkable
class PrefixIndex(Protocol):
    """Read-only prefix lookup. Implementations must be safe to call from several threads."""

    def match(self, instance_id: str, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` held by ``instance_id`` (0 for an unknown instance or
        empty ``keys``). Must not change what is held (no recency update)."""
        ...


@runtime_checkable
class BatchPrefixIndex(PrefixIndex, Protocol):
    """A :class:`PrefixIndex` that matches every instance in one pass over the keys."""

    def match_all(self, instance_ids: Sequence[str], keys: Sequence[bytes]) -> list[int]:
        """``[match(i, keys) for i in instance_ids]``, computed with one holder lookup per key
        (and none past the first key no listed instance holds). Same contract as ``match``."""
        ...


@runtime_checkable
class HolderPrefixIndex(PrefixIndex, Protocol):
    """A :class:`PrefixIndex` that answers for whoever holds the keys, without a list of
    instances: what the conductor prefers (its cost does not grow with the instance count)."""

    def match_holders(self, keys: Sequence[bytes]) -> dict[str, int]:
        """``{instance: match(instance, keys)}`` for every instance whose match is > 0 (absent
        instances match 0; empty ``keys`` give ``{}``). One holder lookup per key, none past
        the first key that no still-matching instance holds. Same contract as ``match``."""
        ...


def prefix_lengths(holder_sets: Iterable[Iterable[str] | None]) -> dict[str, int]:
    """Leading-match length of every instance holding the first key, given each key's holders
    in key order (``None``: nobody holds it). Reads ``holder_sets`` only as far as needed."""
    lengths: dict[str, int] = {}
    alive: set[str] = set()
    depth = 0
    sets = iter(holder_sets)
    for holders in sets:
        if holders is None:
            return lengths
        alive = set(holders)
        break
    while len(alive) > 1:
        depth += 1
        holders = next(sets, None)
        if holders is None:
            break
        if isinstance(holders, dict):
            holders = holders.keys()
        elif not isinstance(holders, set | frozenset):
            holders = set(holders)
        if alive <= holders:  # C-level, allocates nothing: the common case on a shared prefix
            continue
        gone = alive - holders
        for instance_id in gone:
            lengths[instance_id] = depth
        alive -= gone
    else:
        if alive:  # one instance left: a membership test per key
            (last,) = alive
            depth += 1
            for holders in sets:
                if holders is None or last not in holders:
                    break
                depth += 1
    for instance_id in alive:
        lengths[instance_id] = depth
    return lengths


def walk_holders(
    instance_ids: Sequence[str], holder_sets: Iterable[Iterable[str] | None]
) -> list[int]:
    """Leading-match lengths of ``instance_ids`` given each key's holders, in key order.

    Stops reading ``holder_sets`` as soon as no listed instance is still matching, so a lazy
    iterable is read only as far as needed. ``None`` means nobody holds the key. Sparse: after
    the first key only its holders among ``instance_ids`` are tracked (usually a few of them),
    so the cost is one set operation per key plus one pass over ``instance_ids`` at the end.
    """
    if not instance_ids:
        return []
    matched: dict[str, int] = {}  # instance -> its match length, once it stopped matching
    alive: set[str] | None = None
    depth = 0
    for holders in holder_sets:
        if holders is None:
            break
        held = holders if isinstance(holders, set | frozenset | dict) else set(holders)
        if alive is None:
            alive = set(instance_ids)
            alive.intersection_update(held)  # C-level: iterates the smaller side
        else:
            gone = alive.difference(held)  # C-level: one probe of ``held`` per live instance
            if gone:
                for instance_id in gone:
                    matched[instance_id] = depth
                alive -= gone
        if not alive:
            break
        depth += 1
    for instance_id in alive or ():
        matched[instance_id] = depth
    if not matched:
        return [0] * len(instance_ids)
    get = matched.get
    return [get(instance_id, 0) for instance_id in instance_ids]


_Owners: TypeAlias = str | dict[str, None]
"""How :class:`LocalPrefixIndex` stores a key's holders: the instance id itself while it is the
only holder (most keys: no dict built per new block), else a dict of two or more ids (values
None). Read it through :func:`_holder_ids`."""


def _holder_ids(owners: _Owners | None) -> Collection[str] | None:
    """A stored :data:`_Owners` value as a collection of instance ids (``None`` passes through)."""
    return (owners,) if type(owners) is str else owners


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
            if type(first) is str:  # one holder (most keys)
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
                        if type(owners) is str:  # a second holder
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
        if type(owners) is str:  # instance_id itself
            del holders[key]
        else:
            del owners[instance_id]
            if len(owners) == 1:
                (holders[key],) = owners  # the one left

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
