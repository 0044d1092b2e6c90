"""Prefill and decode instances of the embedded cluster, and the decode side's staging area.

A PrefillInstance is an engine (behind its EngineWorker thread) with its own kvdb shard; its
page pool is registered with the transfer engine so that the stream stage can move pages out of
it. A DecodeInstance is an engine with a StagingArea: page-sized slots, registered with the
transfer engine, that streamed KV lands in before the decode engine imports it.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvflow.kvdb import EmbeddedClient, Namespace, Store
from kvflow.router import InstanceState
from kvflow.stages.errors import NoCapacity
from kvflow.stages.runtime.worker import EngineWorker
from kvflow.transfer import SegmentHandle, TransferEngine


def pool_segment_name(instance_id: str) -> str:
    return f"{instance_id}/pool"


def staging_segment_name(instance_id: str) -> str:
    return f"{instance_id}/staging"


class ShardClients:
    """EmbeddedClients of one store, one per namespace (tenant); thread-safe, cached."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._clients: dict[Namespace, EmbeddedClient] = {}
        self._lock = threading.Lock()

    def client(self, namespace: Namespace) -> EmbeddedClient:
        with self._lock:
            client = self._clients.get(namespace)
            if client is None:
                client = self.store.client(namespace)
                self._clients[namespace] = client
            return client


class ShardOwner(Protocol):
    """An instance that holds blocks (prefill or decode; here or on another node)."""

    def match_prefix(self, keys: list[bytes]) -> int: ...

    def client(self, namespace: Namespace) -> Any: ...


@dataclass
class PrefillInstance:
    """One prefill engine and its shard. ``client(ns)`` is thread-safe and cached per tenant.
    ``load_staging`` holds reused page buffers that reuse-load reads cached blocks into."""

    instance_id: str
    worker: EngineWorker
    store: Store
    state: InstanceState
    load_staging: StagingArea | None = None
    _clients: ShardClients = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._clients = ShardClients(self.store)

    def client(self, namespace: Namespace) -> EmbeddedClient:
        return self._clients.client(namespace)

    def match_prefix(self, keys: list[bytes]) -> int:
        """Leading keys held by this instance's shard (any tier)."""
        return self.store.shard.match_prefix(keys)


@dataclass(frozen=True)
class StagingLease:
    """Slots of a StagingArea held by one request, in block order."""

    slots: tuple[int, ...]


class StagingArea:
    """Page-sized slots, allocated once: on a decode instance the streamed KV lands here; on a
    prefill instance reuse-load reads cached blocks here (no fresh allocation per request).

    One torch tensor ``[num_slots, *page_shape]``, registered with the transfer engine (when one
    is given) as segment ``<instance>/staging``. ``lease``/``release`` are thread-safe; a lease
    is released once the engine has imported the pages (or by cleanup on failure).
    """

    def __init__(
        self,
        instance_id: str,
        num_slots: int,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        transfer: TransferEngine | None = None,
        name: str | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.tensor = torch.zeros((num_slots, *page_shape), dtype=dtype)
        self.page_nbytes = int(self.tensor[0].numel() * self.tensor.element_size())
        self.segment_name = name or staging_segment_name(instance_id)
        self.segment: SegmentHandle | None = None
        if transfer is not None:
            transfer.register_memory(self.segment_name, self.tensor.view(torch.uint8).numpy())
            self.segment = transfer.open_segment("local", self.segment_name)
        self._free: deque[int] = deque(range(num_slots))
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lease(self, n: int) -> StagingLease:
        """Take ``n`` slots; NoCapacity (taking none) when fewer are free."""
        with self._lock:
            if n > len(self._free):
                raise NoCapacity(
                    f"decode instance {self.instance_id}: {n} staging pages needed, "
                    f"{len(self._free)} free"
                )
            return StagingLease(tuple(self._free.popleft() for _ in range(n)))

    def release(self, lease: StagingLease) -> None:
        with self._lock:
            self._free.extend(lease.slots)

    def offset(self, slot: int) -> int:
        return slot * self.page_nbytes

    def pages(self, lease: StagingLease, n: int) -> list[Any]:
        """Views of the first ``n`` leased slots, in block order (valid until release)."""
        return [self.tensor[s] for s in lease.slots[:n]]


@dataclass
class DecodeInstance:
    """One decode engine, the staging area streamed KV lands in, and its shard (where the KV
    of the blocks it generated is stored for the next turn of a conversation)."""

    instance_id: str
    worker: EngineWorker
    state: InstanceState
    staging: StagingArea
    store: Store
    _clients: ShardClients = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._clients = ShardClients(self.store)

    def client(self, namespace: Namespace) -> EmbeddedClient:
        return self._clients.client(namespace)

    def match_prefix(self, keys: list[bytes]) -> int:
        """Leading keys held by this instance's shard (any tier)."""
        return self.store.shard.match_prefix(keys)
