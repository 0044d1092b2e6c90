"""The pysyncobj edge: its configuration, per-entry outcomes, and its errors translated.

Nothing here holds state beyond one proposed entry; ``group.py`` owns the lifecycle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pysyncobj import FAIL_REASON, SyncObjConf
from pysyncobj.journal import FileJournal

from kvflow.replication.config import MetadataConfig
from kvflow.replication.errors import (
    MetadataUnavailableError,
    NotLeaderError,
    ReplicationError,
)

CLOSED = -1
"""Our own fail reason for writes still waiting when the group is closed."""
# How long a peer's resolved address is reused (pysyncobj's default: 600 s). Peers named by DNS
# (a Kubernetes StatefulSet's stable names) come back on another IP when rescheduled; the
# others dial the new one within this many seconds, and retry a failed lookup after the next.
DNS_CACHE_S = 5.0
DNS_FAIL_CACHE_S = 1.0

_LEADER_LOST = {
    FAIL_REASON.NOT_LEADER: "leader changed before commit",
    FAIL_REASON.LEADER_CHANGED: "leader changed before commit",
    FAIL_REASON.DISCARDED: "entry discarded by a new leader",
    FAIL_REASON.UNKNOWN_OUTCOME: "outcome unknown after leader restart",
}


class Pending:
    """The outcome of one proposed entry; pysyncobj calls it as ``callback(result, error)``
    on its tick thread (or ``close`` does, with ``CLOSED``). Waiters use ``done``."""

    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: int | None = None

    def __call__(self, result: Any, error: int) -> None:
        self.result, self.error = result, error
        self.done.set()


def raise_for(error: int | None, leader: Callable[[], str | None]) -> None:
    """Raise the kvflow error for a pysyncobj fail reason; return on success."""
    if error == FAIL_REASON.SUCCESS:
        return
    if error in _LEADER_LOST:
        raise NotLeaderError(leader(), _LEADER_LOST[error])
    if error == FAIL_REASON.MISSING_LEADER:
        raise MetadataUnavailableError("no metadata leader is known")
    if error == CLOSED:
        raise MetadataUnavailableError("metadata group closed while the write was in flight")
    if error == FAIL_REASON.QUEUE_FULL:
        raise MetadataUnavailableError("metadata command queue is full")
    raise ReplicationError(f"metadata write failed (pysyncobj reason {error})")


def persists_term_and_vote() -> bool:
    """Whether the installed pysyncobj keeps ``currentTerm``/``votedFor`` in its journal
    (``raft.journal.meta``, written before a vote is answered: the fix of its PR 202, shipped
    in 0.3.17). Without it a replica restarted from its journal could vote twice in one term."""
    return all(
        callable(getattr(FileJournal, name, None))
        for name in ("setCurrentTerm", "getCurrentTerm", "getVotedForNodeId")
    )


def check_restart_safe(config: MetadataConfig) -> None:
    """Refuse to run a replica of a multi-replica group with a file journal on a pysyncobj
    that does not persist its term and vote (see :func:`persists_term_and_vote`)."""
    journaled_group = bool(config.partner_addresses) and config.journal_dir is not None
    if journaled_group and not persists_term_and_vote():
        raise ReplicationError(
            "the installed pysyncobj does not persist currentTerm/votedFor (needs >= 0.3.17);"
            " a replica restarted from its journal could vote twice in one term"
        )


def syncobj_conf(config: MetadataConfig) -> SyncObjConf:
    """pysyncobj settings for one replica. Ticking is manual (``autoTick=False``): the group
    runs its own tick thread, so the replica does not stop when the thread that created it
    exits (pysyncobj's auto-tick thread watches its creator thread)."""
    journal, dump = config.journal_path, config.dump_path
    return SyncObjConf(
        autoTick=False,
        appendEntriesUseBatch=False,  # send entries as soon as proposed: lower commit latency
        appendEntriesPeriod=config.append_entries_period_s,
        raftMinTimeout=config.raft_min_timeout_s,
        raftMaxTimeout=config.raft_max_timeout_s,
        connectionTimeout=max(3.5, config.raft_max_timeout_s * 2),
        connectionRetryTime=config.connection_retry_s,
        leaderFallbackTimeout=max(30.0, config.raft_max_timeout_s * 4),
        # One entry never exceeds max_entry_bytes of keys (+ tiers and framing), so it is
        # never sent through pysyncobj's chunked "transmission" path.
        appendEntriesBatchSizeBytes=2 * config.max_entry_bytes + (1 << 16),
        journalFile=None if journal is None else str(journal),
        # A file journal is compacted into this dump; without it compaction would drop
        # journal entries whose effect lives only in memory.
        fullDumpFile=None if dump is None else str(dump),
        useFork=False,  # no fork() in a threaded (torch, grpc) process
        logCompactionMinEntries=config.log_compaction_min_entries,
        logCompactionMinTime=config.log_compaction_min_time_s,
        bindRetryTime=config.bind_retry_s,
        maxBindRetries=config.bind_retries,
        commandsWaitLeader=True,
        dynamicMembershipChange=False,
        dnsCacheTime=DNS_CACHE_S,
        dnsFailCacheTime=DNS_FAIL_CACHE_S,
        # Bind the configured host only: without bindAddress pysyncobj binds 0.0.0.0.
        bindAddress=config.self_address,
        password=config.password,
    )
