"""What a caller of the metadata needs, as Protocols: satisfied by an in-process
:class:`MetadataGroup` replica and by a :class:`RemoteMetadata` gRPC client alike.

kvdb (``open_store``, ``MetadataSync``, ``MetadataReplicas``) and routers can be typed
against these instead of a concrete class, so the embedded store and a cluster of meta
processes are interchangeable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvflow.replication.types import NodeId, NodeInfo, Tier


class MetadataReader(Protocol):
    """Read-only queries (``MetadataView``, ``RemoteMetadataView``)."""

    def replicas(self, key: bytes) -> dict[NodeId, Tier]: ...

    def replica_count(self, key: bytes) -> int: ...

    def replica_target(self, key: bytes) -> int: ...

    def holders(self, keys: Sequence[bytes]) -> list[dict[NodeId, Tier]]: ...

    def blocks_on(self, node: NodeId) -> int: ...

    def keys_on(self, node: NodeId) -> list[bytes]: ...

    def nodes(self) -> list[NodeInfo]: ...

    def num_blocks(self) -> int: ...

    def is_leader(self) -> bool: ...

    def leader(self) -> str | None: ...


class MetadataClient(Protocol):
    """Lifecycle and writes (``MetadataGroup``, ``RemoteMetadata``); every write is
    idempotent and raises a ``ReplicationError`` when its outcome is unknown."""

    def start(self) -> None: ...

    def wait_ready(self, timeout: float) -> None: ...

    def close(self) -> None: ...

    def record_batch(
        self,
        node: NodeId,
        stored: Sequence[tuple[bytes, Tier]],
        removed: Sequence[bytes],
        now: float,
    ) -> None: ...

    def replace_holdings(
        self, node: NodeId, holdings: Sequence[tuple[bytes, Tier]], now: float
    ) -> None: ...

    def set_replica_target(self, key: bytes, n: int, now: float) -> None: ...

    def register_node(self, node: NodeId, address: str, kind: str, now: float) -> None: ...

    def heartbeat(self, node: NodeId, now: float) -> bool: ...

    def reap_dead_nodes(self, now: float) -> list[NodeId]: ...

    def view(self) -> MetadataReader: ...
