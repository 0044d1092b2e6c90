"""The metadata state machine: which node holds which block in which tier.

:class:`MetadataTable` is a plain, deterministic class: no I/O, no clock, no threads, no
randomness. Every replica of the group applies the same commands in the same order and
ends in the same state; the time a command needs (``now``) is one of its arguments. The
Raft shell (``group.py``) wraps it; tests drive it directly with a hand-held clock.

State:
  * ``replicas``: block key -> {node: tier value}
  * ``holdings``: node -> set of keys (the same facts indexed by node, for reaping)
  * ``targets``: block key -> desired replica count (only when not the default 1)
  * ``nodes``: node -> membership record (address, kind, registration and heartbeat times)

Commands are idempotent: applying one twice leaves the same state as applying it once, so a
caller may retry any command whose outcome it does not know.

Thread-safety: none. The shell serializes commands and readers with one lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.replication.codec import check_key, check_keys, check_node, check_now, split_stored
from kvflow.replication.jobs import JOB_OPS, JobTable
from kvflow.replication.types import TIERS_BY_VALUE, NodeId, NodeInfo, Tier

DEFAULT_REPLICA_TARGET = 1
SNAPSHOT_VERSION = 1


@dataclass(slots=True)
class _Member:
    address: str
    kind: str
    registered_at: float
    last_heartbeat: float


class MetadataTable:
    """The replicated metadata of one group (see the module docstring).

    Mutating methods are the group's commands; each validates its arguments (``TypeError``
    or ``ValueError`` naming the argument, nothing changed) except the ``apply_*`` fast
    paths, which the Raft shell calls with already-validated, decoded payloads.
    """

    def __init__(self) -> None:
        self._replicas: dict[bytes, dict[str, int]] = {}
        self._holdings: dict[str, set[bytes]] = {}
        self._targets: dict[bytes, int] = {}
        self._members: dict[str, _Member] = {}
        self._commands_applied = 0
        self._clock = 0.0
        self.jobs = JobTable()  # background jobs' records (jobs.py); commands via apply_job

    # ------------------------------------------------------------------ commands

    def record_batch(
        self,
        node: NodeId,
        stored: Sequence[tuple[bytes, Tier]],
        removed: Sequence[bytes],
        now: float,
    ) -> None:
        """Record that ``node`` now holds ``stored`` (key, tier) and no longer holds ``removed``.

        Stores are applied first, then removals: a key in both lists ends up not held by
        ``node``. Storing a key the node already holds updates its tier; removing a key it
        does not hold is a no-op. A node not yet known is registered implicitly (empty
        address and kind); the write also counts as a heartbeat. A block whose last replica
        is removed loses its replica target too.
        """
        check_node(node)
        keys, tiers = split_stored(stored)
        gone = check_keys(removed, "removed")
        self.apply_record(node, keys, tiers, gone, check_now(now))

    def apply_record(
        self,
        node: str,
        keys: Sequence[bytes],
        tiers: bytes,
        removed: Sequence[bytes],
        now: float,
    ) -> None:
        """Trusted fast path of :meth:`record_batch`: ``tiers[i]`` is the tier of ``keys[i]``."""
        self._touch(node, now)
        held = self._holdings[node]
        replicas = self._replicas
        for key, tier in zip(keys, tiers, strict=True):
            holders = replicas.get(key)
            if holders is None:
                replicas[key] = {node: tier}
            else:
                holders[node] = tier
        held.update(keys)
        for key in removed:
            if key in held:
                held.discard(key)
                self._drop_replica(key, node)
        self._commands_applied += 1

    def replace_holdings(
        self, node: NodeId, holdings: Sequence[tuple[bytes, Tier]], now: float
    ) -> None:
        """Make ``holdings`` exactly what is recorded for ``node`` (re-adoption, rebuild).

        Everything previously recorded for the node is dropped first. Registers the node
        implicitly if unknown and counts as a heartbeat.
        """
        check_node(node)
        keys, tiers = split_stored(holdings)
        self.apply_replace(node, keys, tiers, check_now(now))

    def apply_replace(self, node: str, keys: Sequence[bytes], tiers: bytes, now: float) -> None:
        """Trusted fast path of :meth:`replace_holdings` (one chunk: clear, then record)."""
        self._forget_holdings(node)
        self.apply_record(node, keys, tiers, (), now)

    def set_replica_target(self, key: bytes, n: int, now: float) -> None:
        """Set how many replicas ``key`` should have (``n >= 1``; 1 is the default)."""
        check_key(key)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: replica target must be an int >= 1, got {n!r}")
        self.apply_target(key, n, check_now(now))

    def apply_target(self, key: bytes, n: int, now: float) -> None:
        """Trusted fast path of :meth:`set_replica_target`."""
        self._advance(now)
        if n == DEFAULT_REPLICA_TARGET:
            self._targets.pop(key, None)
        else:
            self._targets[key] = n
        self._commands_applied += 1

    def register_node(self, node: NodeId, address: str, kind: str, now: float) -> None:
        """Add ``node`` or update its address and kind; counts as a heartbeat.

        Re-registering keeps the node's recorded blocks and its first registration time.
        """
        check_node(node)
        if not isinstance(address, str) or not isinstance(kind, str):
            raise TypeError("address and kind: expected str")
        self.apply_register(node, address, kind, check_now(now))

    def apply_register(self, node: str, address: str, kind: str, now: float) -> None:
        """Trusted fast path of :meth:`register_node`."""
        member = self._touch(node, now)
        member.address = address
        member.kind = kind
        self._commands_applied += 1

    def heartbeat(self, node: NodeId, now: float) -> bool:
        """Mark ``node`` alive at ``now``. Returns False if the node was unknown (never
        registered, or reaped): it is registered now with no blocks, and should call
        ``replace_holdings`` to re-adopt what it holds."""
        check_node(node)
        return self.apply_heartbeat(node, check_now(now))

    def apply_heartbeat(self, node: str, now: float) -> bool:
        """Trusted fast path of :meth:`heartbeat`."""
        known = node in self._members
        self._touch(node, now)
        self._commands_applied += 1
        return known

    def reap_dead_nodes(self, now: float, dead_after_s: float) -> list[NodeId]:
        """Drop every node whose last heartbeat is more than ``dead_after_s`` before ``now``,
        with all its replicas. Returns the dropped nodes, sorted."""
        now = check_now(now)
        if check_now(dead_after_s) <= 0:
            raise ValueError(f"dead_after_s: must be positive, got {dead_after_s!r}")
        return self.apply_reap(now, dead_after_s)

    def apply_reap(self, now: float, dead_after_s: float) -> list[NodeId]:
        """Trusted fast path of :meth:`reap_dead_nodes`."""
        self._advance(now)
        dead = sorted(
            node for node, m in self._members.items() if now - m.last_heartbeat > dead_after_s
        )
        for node in dead:
            self._forget_holdings(node)
            del self._holdings[node]
            del self._members[node]
        self._commands_applied += 1
        return [NodeId(node) for node in dead]

    # ------------------------------------------------------------------ reads

    def replicas(self, key: bytes) -> dict[NodeId, Tier]:
        """The nodes holding ``key`` and in which tier (a new dict; empty if none)."""
        holders = self._replicas.get(key)
        if not holders:
            return {}
        return {NodeId(node): TIERS_BY_VALUE[tier] for node, tier in holders.items()}

    def replica_count(self, key: bytes) -> int:
        """How many nodes hold ``key``."""
        holders = self._replicas.get(key)
        return 0 if holders is None else len(holders)

    def replica_target(self, key: bytes) -> int:
        """The desired replica count of ``key`` (1 unless set)."""
        return self._targets.get(key, DEFAULT_REPLICA_TARGET)

    def holders(self, keys: Iterable[bytes]) -> list[dict[NodeId, Tier]]:
        """``[replicas(k) for k in keys]``, in order."""
        return [self.replicas(key) for key in keys]

    def under_replicated(self, limit: int) -> list[tuple[bytes, int, int]]:
        """Up to ``limit`` held keys with fewer replicas than their target, as
        ``(key, replica_count, target)``, sorted by key."""
        found = sorted(
            (key, self.replica_count(key), n)
            for key, n in self._targets.items()
            if 0 < self.replica_count(key) < n
        )
        return found[: max(limit, 0)]

    def blocks_on(self, node: NodeId) -> int:
        """How many blocks ``node`` holds (0 for an unknown node)."""
        held = self._holdings.get(node)
        return 0 if held is None else len(held)

    def keys_on(self, node: NodeId) -> list[bytes]:
        """The keys ``node`` holds, sorted (a new list)."""
        return sorted(self._holdings.get(node, ()))

    def tier_of(self, key: bytes, node: NodeId) -> Tier | None:
        """The tier of ``node``'s replica of ``key``, or None if it holds none."""
        holders = self._replicas.get(key)
        tier = None if holders is None else holders.get(node)
        return None if tier is None else TIERS_BY_VALUE[tier]

    def node_info(self, node: NodeId) -> NodeInfo | None:
        """The record of ``node``, or None if unknown."""
        member = self._members.get(node)
        if member is None:
            return None
        return NodeInfo(
            node=node,
            address=member.address,
            kind=member.kind,
            registered_at=member.registered_at,
            last_heartbeat=member.last_heartbeat,
            num_blocks=len(self._holdings[node]),
        )

    def nodes(self) -> list[NodeInfo]:
        """Every known node, sorted by id."""
        infos = (self.node_info(NodeId(node)) for node in sorted(self._members))
        return [info for info in infos if info is not None]

    def num_blocks(self) -> int:
        """How many distinct keys have at least one replica."""
        return len(self._replicas)

    @property
    def commands_applied(self) -> int:
        """How many commands (Raft entries of this table) have been applied."""
        return self._commands_applied

    @property
    def clock(self) -> float:
        """The largest ``now`` any applied command carried (0.0 before the first)."""
        return self._clock

    def apply_job(
        self,
        op: str,
        job_id: str,
        owner: str,
        doc: bytes,
        events: Sequence[bytes],
        lease_s: float,
        now: float,
    ) -> bool:
        """One job command (``JOB_OPS``) on :attr:`jobs`; see :class:`JobTable`."""
        self._advance(now)
        self._commands_applied += 1
        if op == "create":
            return self.jobs.create(job_id, doc, owner, lease_s, now)
        if op == "claim":
            return self.jobs.claim(job_id, owner, lease_s, now)
        if op == "append":
            return self.jobs.append(job_id, owner, events)
        if op == "release":
            return self.jobs.release(job_id, owner)
        raise ValueError(f"op: one of {JOB_OPS}, got {op!r}")

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> dict[str, Any]:
        """The whole state as plain data (dicts, sets, tuples of str/bytes/int/float).

        The returned containers are the table's own, not copies: serialize the result before
        the next command is applied (the Raft shell does, on its tick thread).
        """
        return {
            "version": SNAPSHOT_VERSION,
            "replicas": self._replicas,
            "targets": self._targets,
            "members": {
                node: (m.address, m.kind, m.registered_at, m.last_heartbeat)
                for node, m in self._members.items()
            },
            "commands_applied": self._commands_applied,
            "clock": self._clock,
            "jobs": self.jobs.snapshot(),
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Replace the whole state with ``snapshot`` (from :meth:`snapshot`); takes ownership."""
        if snapshot.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"snapshot: unsupported version {snapshot.get('version')!r}")
        self._replicas = snapshot["replicas"]
        self._targets = snapshot["targets"]
        self._members = {node: _Member(*fields) for node, fields in snapshot["members"].items()}
        self._holdings = {node: set() for node in self._members}
        for key, holders in self._replicas.items():
            for node in holders:
                self._holdings.setdefault(node, set()).add(key)
        self._commands_applied = snapshot["commands_applied"]
        self._clock = snapshot["clock"]
        self.jobs = JobTable()
        self.jobs.restore(snapshot.get("jobs", {}))  # absent in snapshots older than jobs

    # ------------------------------------------------------------------ internals

    def _advance(self, now: float) -> None:
        if now > self._clock:
            self._clock = now

    def _touch(self, node: str, now: float) -> _Member:
        """Register ``node`` if unknown; move its heartbeat forward to ``now`` (never back)."""
        self._advance(now)
        member = self._members.get(node)
        if member is None:
            member = _Member(address="", kind="", registered_at=now, last_heartbeat=now)
            self._members[node] = member
            self._holdings[node] = set()
        elif now > member.last_heartbeat:
            member.last_heartbeat = now
        return member

    def _forget_holdings(self, node: str) -> None:
        held = self._holdings.get(node)
        if not held:
            return
        for key in held:
            self._drop_replica(key, node)
        held.clear()

    def _drop_replica(self, key: bytes, node: str) -> None:
        holders = self._replicas.get(key)
        if holders is None:
            return
        holders.pop(node, None)
        if not holders:
            del self._replicas[key]
            self._targets.pop(key, None)
