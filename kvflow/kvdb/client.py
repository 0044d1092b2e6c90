"""KVClient: the client API, one interface for the embedded store and (later) a remote one.

Every method of every implementation is thread-safe. Keys are 16-byte ``BlockKey``s from
``kvdb.keys.block_keys``; values are a block's raw bytes (bytes-like, numpy array or torch CPU
tensor; copied on put, the caller keeps ownership). Misses are return values (None / False /
a shorter prefix), never exceptions.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.kvdb.buffers import readable_bytes, writable_bytes
from kvflow.kvdb.errors import (
    BlockPinnedError,
    KVDBError,
    NamespaceMismatchError,
    NotEnoughReplicasError,
    ValueSizeError,
)
from kvflow.kvdb.events import BlockEvent
from kvflow.kvdb.keys import BlockKey, Namespace
from kvflow.kvdb.remote.replica_writer import BlockToCopy, ReplicaWriter
from kvflow.kvdb.shard import Shard
from kvflow.kvdb.stats import StoreStats
from kvflow.replication import MetadataGroup, Tier


class KVClient(abc.ABC):
    """The client API. Batch forms default to loops over the single forms; a remote client
    overrides them with one round trip."""

    @property
    @abc.abstractmethod
    def namespace(self) -> Namespace:
        """The namespace whose keys this client reads and writes."""

    @abc.abstractmethod
    def put(
        self, key: bytes, value: Any, parent: bytes | None = None, replicas: int = 1
    ) -> Tier | None:
        """Store a block; ``parent`` is the previous key of its chain (for prefix-aware
        eviction). Returns the tier it is in, or None if the store had no room. Raises
        ValueSizeError for a value of the wrong size, StoreFullError if the device is full.
        ``replicas`` > 1: returns only once that many distinct nodes hold the block and the
        metadata records them (docs/durability.md); NotEnoughReplicasError otherwise."""

    @abc.abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The value as new bytes, or None."""

    @abc.abstractmethod
    def get_into(self, key: bytes, buf: Any) -> Tier | None:
        """Copy the value into ``buf`` (writable, exactly the value's size); returns the tier
        that served it or None (miss). ValueSizeError if ``buf`` has the wrong size."""

    @abc.abstractmethod
    def exists(self, key: bytes) -> bool:
        """Whether the block is held in any tier."""

    @abc.abstractmethod
    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """Length of the longest run of leading ``keys`` present (SGLang's batch_exists)."""

    @abc.abstractmethod
    def remove(self, key: bytes) -> bool:
        """Remove a block; False if absent. BlockPinnedError if pinned."""

    @abc.abstractmethod
    def pin(self, keys: Sequence[bytes]) -> list[bool]:
        """Pin held blocks against eviction (counted); per key, whether it was held."""

    @abc.abstractmethod
    def unpin(self, keys: Sequence[bytes]) -> None:
        """Release one pin per key; NotPinnedError (nothing changed) if a key has none."""

    @abc.abstractmethod
    def change_replica(self, key: bytes, n: int) -> None:
        """Set the block's replica target (recorded in the metadata; the cluster acts on it)."""

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """Per-tier hits, misses, bytes, evictions, demotions, promotions, corruptions."""

    @abc.abstractmethod
    def take_events(self) -> list[BlockEvent]:
        """Drain the outbox of BlockStored / BlockRemoved events (oldest first)."""

    def batch_put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        parents: Sequence[bytes | None] | None = None,
    ) -> list[Tier | None]:
        """put for each pair. ``parents=None`` means the keys are one chain in order: each
        key's parent is the key before it (the first has none). Stops at the first exception
        (earlier blocks stay stored)."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        if parents is None:
            parents = [None, *keys[:-1]]
        elif len(parents) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parents)} parents")
        return [self.put(k, v, p) for k, v, p in zip(keys, values, parents, strict=True)]

    def batch_get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def batch_get_into(self, keys: Sequence[bytes], bufs: Sequence[Any]) -> list[Tier | None]:
        """get_into for each pair."""
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        return [self.get_into(k, b) for k, b in zip(keys, bufs, strict=True)]

    def batch_exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def batch_remove(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.remove(k) for k in keys]

    def batch_change_replica(self, keys: Sequence[bytes], n: int) -> None:
        for key in keys:
            self.change_replica(key, n)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release client resources (the embedded client owns none)."""


class EmbeddedClient(KVClient):
    """A client over a Shard in this process. The shard must serve ``namespace``'s model
    (NamespaceMismatchError otherwise); several clients (tenants) may share a shard. Values
    must be exactly ``namespace.layout.block_nbytes`` (ValueSizeError otherwise)."""

    def __init__(
        self,
        shard: Shard,
        namespace: Namespace,
        metadata: MetadataGroup | None = None,
        clock: Callable[[], float] = time.time,
        writer: ReplicaWriter | None = None,
    ) -> None:
        if namespace.fingerprint() != shard.fingerprint:
            raise NamespaceMismatchError(
                f"namespace fingerprint {namespace.fingerprint()} (model "
                f"{namespace.model_fingerprint!r}) != shard fingerprint {shard.fingerprint}"
            )
        self._shard = shard
        self._namespace = namespace
        self._nbytes = namespace.layout.block_nbytes
        self._metadata = metadata
        self._clock = clock
        self._writer = writer

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def shard(self) -> Shard:
        return self._shard

    def _check(self, nbytes: int, what: str) -> None:
        if nbytes != self._nbytes:
            raise ValueSizeError(
                f"{what} has {nbytes} bytes; a block of this namespace is {self._nbytes}"
            )

    def put(
        self, key: bytes, value: Any, parent: bytes | None = None, replicas: int = 1
    ) -> Tier | None:
        """The block is owned by this client's namespace's tenant. ``replicas`` > 1 needs the
        store's ReplicaWriter (a node of a cluster); a single node refuses it."""
        src = readable_bytes(value)
        self._check(src.shape[0], "value")
        if replicas == 1:
            return self._shard.put(key, src, parent, self._namespace.tenant)
        if self._writer is None:
            raise NotEnoughReplicasError(
                f"replicas={replicas}: this store has no peers to copy to (one node)"
            )
        had = self._shard.exists(key)
        tier = self._shard.put(key, src, parent, self._namespace.tenant)
        try:
            block = BlockToCopy(key, src, parent, self._namespace.tenant)
            self._writer.write([block], replicas, held_locally=tier is not None)
        except NotEnoughReplicasError:
            if tier is not None and not had:  # not acknowledged: take our copy back
                with contextlib.suppress(BlockPinnedError):
                    self._shard.remove(key)
            raise
        return tier

    def get(self, key: bytes) -> bytes | None:
        return self._shard.get(key)

    def get_into(self, key: bytes, buf: Any) -> Tier | None:
        dst = writable_bytes(buf)
        self._check(dst.shape[0], "buffer")
        return self._shard.get_into(key, dst)

    def exists(self, key: bytes) -> bool:
        return self._shard.exists(key)

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return self._shard.match_prefix(keys)

    def remove(self, key: bytes) -> bool:
        return self._shard.remove(key)

    def pin(self, keys: Sequence[bytes]) -> list[bool]:
        return self._shard.pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        self._shard.unpin(keys)

    def change_replica(self, key: bytes, n: int) -> None:
        if self._metadata is None:
            raise KVDBError("change_replica needs a metadata group (open the store with one)")
        self._metadata.set_replica_target(BlockKey(key), n, self._clock())

    def stats(self) -> StoreStats:
        return self._shard.stats()

    def take_events(self) -> list[BlockEvent]:
        return self._shard.take_events()
