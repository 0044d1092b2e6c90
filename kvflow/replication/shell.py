"""The thin pysyncobj shell around :class:`MetadataTable`.

Each ``@replicated`` method is one kind of Raft entry. Its arguments are the compact payload
of ``codec.py`` (a few ``bytes`` and ints, never one object per block); applying it decodes
the payload and calls the table's trusted ``apply_*`` path under the state lock.

Applying never raises: pysyncobj would retry a raising entry forever on its tick thread.
Payloads are validated before they are proposed, so a failure here is a bug; it is logged
and the entry is skipped identically on every replica (the table is deterministic).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pysyncobj import SyncObjConsumer, replicated

from kvflow.replication.codec import unpack_keys
from kvflow.replication.table import MetadataTable

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ReplicatedTable(SyncObjConsumer):  # type: ignore[misc]
    """Owns the replica's :class:`MetadataTable` and the lock that guards it.

    Thread-safety: commands are applied on the Raft tick thread; readers take ``lock``
    (an ``RLock``) and read ``table`` — look ``table`` up on every read, since installing a
    snapshot replaces its contents.
    """

    def __init__(self) -> None:
        # Attributes set before SyncObjConsumer.__init__ are excluded from its default
        # serialization; _serialize/_deserialize below define the snapshot anyway.
        self.lock = threading.RLock()
        self.table = MetadataTable()
        super().__init__()

    def _serialize(self) -> dict[str, Any]:
        with self.lock:
            return {"table": self.table.snapshot()}

    def _deserialize(self, data: dict[str, Any]) -> None:
        fresh = MetadataTable()
        fresh.restore(data["table"])
        with self.lock:
            self.table = fresh
        logger.info("metadata snapshot installed: blocks=%d", fresh.num_blocks())

    def _apply(self, command: str, fn: Callable[[MetadataTable], T]) -> T | None:
        with self.lock:
            try:
                return fn(self.table)
            except Exception:
                logger.exception("metadata command %s failed to apply; skipped", command)
                return None

    @replicated
    def cmd_record(
        self,
        node: str,
        width: int,
        blob: bytes,
        tiers: bytes,
        removed_width: int,
        removed_blob: bytes,
        now: float,
    ) -> None:
        keys = unpack_keys(width, blob)
        removed = unpack_keys(removed_width, removed_blob)
        self._apply("record", lambda t: t.apply_record(node, keys, tiers, removed, now))

    @replicated
    def cmd_replace(self, node: str, width: int, blob: bytes, tiers: bytes, now: float) -> None:
        keys = unpack_keys(width, blob)
        self._apply("replace", lambda t: t.apply_replace(node, keys, tiers, now))

    @replicated
    def cmd_target(self, key: bytes, n: int, now: float) -> None:
        self._apply("target", lambda t: t.apply_target(key, n, now))

    @replicated
    def cmd_register(self, node: str, address: str, kind: str, now: float) -> None:
        self._apply("register", lambda t: t.apply_register(node, address, kind, now))

    @replicated
    def cmd_heartbeat(self, node: str, now: float) -> bool | None:
        return self._apply("heartbeat", lambda t: t.apply_heartbeat(node, now))

    @replicated
    def cmd_job(
        self,
        op: str,
        job_id: str,
        owner: str,
        doc: bytes,
        events: list[bytes],
        lease_s: float,
        now: float,
    ) -> bool | None:
        return self._apply(
            "job", lambda t: t.apply_job(op, job_id, owner, doc, events, lease_s, now)
        )

    @replicated
    def cmd_reap(self, now: float, dead_after_s: float) -> list[str] | None:
        return self._apply("reap", lambda t: list(t.apply_reap(now, dead_after_s)))
