"""A read-only view of one replica's applied metadata, for routers and admin tools."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from kvflow.replication.jobs import JobRecord
from kvflow.replication.table import MetadataTable
from kvflow.replication.types import NodeId, NodeInfo, Tier


class RaftRole(Protocol):
    """What a view can ask about the replica's Raft role."""

    def is_leader(self) -> bool: ...

    def leader(self) -> str | None: ...


class _Standalone:
    """The role of a table with no Raft group behind it: never a leader, no leader known."""

    def is_leader(self) -> bool:
        return False

    def leader(self) -> str | None:
        return None


class MetadataView:
    """Read-only, thread-safe queries of the state this replica has applied.

    Any replica serves reads; a follower's view may lag the leader by the entries it has
    not applied yet (read-your-writes holds on the replica that issued the write, since a
    write returns only after this replica applied it). Every method returns new objects
    the caller owns; none mutates anything. Each call takes the replica's state lock, so a
    single call sees one consistent state; two calls may see different states.
    """

    def __init__(
        self,
        table: Callable[[], MetadataTable],
        lock: threading.RLock,
        role: RaftRole,
    ) -> None:
        self._table = table
        self._lock = lock
        self._role = role

    @classmethod
    def of_table(cls, table: MetadataTable) -> MetadataView:
        """A view over a bare table (tests, simulators): ``is_leader()`` is False and
        ``leader()`` None. The caller must not mutate the table while reading through it
        from another thread."""
        return cls(lambda: table, threading.RLock(), _Standalone())

    def replicas(self, key: bytes) -> dict[NodeId, Tier]:
        """The nodes holding ``key`` and in which tier; empty if none."""
        with self._lock:
            return self._table().replicas(key)

    def replica_count(self, key: bytes) -> int:
        """How many nodes hold ``key``."""
        with self._lock:
            return self._table().replica_count(key)

    def replica_target(self, key: bytes) -> int:
        """The desired replica count of ``key`` (1 unless set)."""
        with self._lock:
            return self._table().replica_target(key)

    def holders(self, keys: Sequence[bytes]) -> list[dict[NodeId, Tier]]:
        """``replicas`` of each key, in order, read under one lock (one consistent state)."""
        with self._lock:
            return self._table().holders(keys)

    def tier_of(self, key: bytes, node: NodeId) -> Tier | None:
        """The tier of ``node``'s replica of ``key``, or None if it holds none."""
        with self._lock:
            return self._table().tier_of(key, node)

    def under_replicated(self, limit: int = 100) -> list[tuple[bytes, int, int]]:
        """Up to ``limit`` held keys below their replica target: ``(key, count, target)``."""
        with self._lock:
            return self._table().under_replicated(limit)

    def blocks_on(self, node: NodeId) -> int:
        """How many blocks ``node`` holds."""
        with self._lock:
            return self._table().blocks_on(node)

    def keys_on(self, node: NodeId) -> list[bytes]:
        """The keys ``node`` holds, sorted."""
        with self._lock:
            return self._table().keys_on(node)

    def node_info(self, node: NodeId) -> NodeInfo | None:
        """The record of ``node``, or None if unknown (never registered, or reaped)."""
        with self._lock:
            return self._table().node_info(node)

    def nodes(self) -> list[NodeInfo]:
        """Every known node, sorted by id."""
        with self._lock:
            return self._table().nodes()

    def num_blocks(self) -> int:
        """How many distinct keys have at least one replica."""
        with self._lock:
            return self._table().num_blocks()

    def jobs(self, job_id: str = "") -> list[JobRecord]:
        """Every job's record (oldest first), or only ``job_id``'s (empty when unknown)."""
        with self._lock:
            jobs = self._table().jobs
            ids = [job_id] if job_id else jobs.ids()
            return [r for j in ids if (r := jobs.record(j)) is not None]

    def commands_applied(self) -> int:
        """How many metadata commands this replica has applied."""
        with self._lock:
            return self._table().commands_applied

    def is_leader(self) -> bool:
        """Whether this replica believes it is the Raft leader (may be briefly stale)."""
        return self._role.is_leader()

    def leader(self) -> str | None:
        """The address of the leader as this replica knows it, or None."""
        return self._role.leader()
