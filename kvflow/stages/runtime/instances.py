"""Prefill and decode instances of the embedded cluster, and the decode side's staging area.

A PrefillInstance is an engine (behind its EngineWorker thread) with its own kvdb shard; its
page pool is registered with the transfer engine so that the stream stage can move pages out of
it. A DecodeInstance is an engine with a StagingArea: page-sized slots, registered with the
transfer engine, that streamed KV lands in before the decode engine imports it.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from kvflow.kvdb import EmbeddedClient, Namespace, Store
from kvflow.router import InstanceState
from kvflow.stages.runtime.staging import StagingArea
from kvflow.stages.runtime.store_gate import StoreGate
from kvflow.stages.runtime.worker import EngineWorker


def pool_segment_name(instance_id: str) -> str:
    return f"{instance_id}/pool"


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


class Instance:
    """One engine (behind its worker thread) and its kvdb shard, with the router's books of
    it (``state``). ``client(ns)`` is thread-safe and cached per tenant. The two kinds differ
    only in the staging area they own."""

    kind = ""

    def __init__(
        self, instance_id: str, worker: EngineWorker, store: Store, state: InstanceState
    ) -> None:
        self.instance_id = instance_id
        self.worker = worker
        self.store = store
        self.state = state
        self._clients = ShardClients(store)

    def client(self, namespace: Namespace) -> EmbeddedClient:
        return self._clients.client(namespace)

    def match_prefix(self, keys: list[bytes]) -> int:
        """Leading keys held by this instance's shard (any tier)."""
        return self.store.shard.match_prefix(keys)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.instance_id!r})"


class PrefillInstance(Instance):
    """A prefill engine. ``load_staging`` holds reused page buffers that reuse-load reads
    cached blocks into (None: fresh buffers per request)."""

    kind = "prefill"

    def __init__(
        self,
        instance_id: str,
        worker: EngineWorker,
        store: Store,
        state: InstanceState,
        load_staging: StagingArea | None = None,
    ) -> None:
        super().__init__(instance_id, worker, store, state)
        self.load_staging = load_staging
        self.store_gate = StoreGate()  # colocated, prompt stores wait for others' first tokens


class DecodeInstance(Instance):
    """A decode engine, the staging area streamed KV lands in, and its shard (where the KV of
    the blocks it generated is stored for the next turn of a conversation)."""

    kind = "decode"

    def __init__(
        self,
        instance_id: str,
        worker: EngineWorker,
        state: InstanceState,
        staging: StagingArea,
        store: Store,
    ) -> None:
        super().__init__(instance_id, worker, store, state)
        self.staging = staging
