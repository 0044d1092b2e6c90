"""One replica of the Raft metadata group: lifecycle, tick thread, blocking writes.

``MetadataGroup`` owns a pysyncobj ``SyncObj`` (no auto-tick: this class runs the tick
thread, so the group keeps running whichever thread started it) with one consumer, the
:class:`ReplicatedTable`. Writes are proposed on any replica (a follower forwards them to
the leader) and block until this replica has applied them, so a write is visible in this
replica's :meth:`view` when it returns.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from pysyncobj import SyncObj, SyncObjException

from kvflow.replication.codec import (
    check_key,
    check_keys,
    check_node,
    check_now,
    chunk_bounds,
    pack_keys,
    split_stored,
)
from kvflow.replication.config import MetadataConfig
from kvflow.replication.dir_guard import DirClaim, claim_dir
from kvflow.replication.errors import MetadataTimeoutError, MetadataUnavailableError
from kvflow.replication.jobs import JobRecord, check_job_write
from kvflow.replication.journal_repair import VoteHold, repair_journal
from kvflow.replication.raft import (
    CLOSED,
    Pending,
    check_restart_safe,
    raise_for,
    syncobj_conf,
)
from kvflow.replication.raft_gate import GatedTransport
from kvflow.replication.shell import ReplicatedTable
from kvflow.replication.types import NodeId, Tier
from kvflow.replication.view import MetadataView

logger = logging.getLogger(__name__)

_FAST_TICKS = 4
"""Zero-wait ticks run after a write is proposed, so it commits without waiting a period."""


class MetadataGroup:
    """One replica of the metadata group (see the module docstring).

    Lifecycle: ``start()`` binds ``self_address`` and starts the tick thread; ``wait_ready``
    waits for a leader and for this replica to catch up; ``close()`` (idempotent) stops the
    tick thread and closes sockets and journal. Usable as a context manager (start/close).

    Writes (thread-safe, blocking up to ``commit_timeout_s``) raise:
    ``MetadataTimeoutError`` (not committed in time: outcome unknown),
    ``NotLeaderError`` (leadership changed before commit: outcome unknown),
    ``MetadataUnavailableError`` (not started / closed / no leader / queue full),
    ``TypeError``/``ValueError`` for bad arguments (nothing proposed). Every command is
    idempotent, so retrying after any of these is safe.
    """

    def __init__(self, config: MetadataConfig) -> None:
        if not isinstance(config, MetadataConfig):
            raise TypeError(f"config: expected MetadataConfig, got {type(config).__name__}")
        self._config = config
        self._shell = ReplicatedTable()
        self._syncobj: SyncObj | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._state_lock = threading.Lock()
        self._closed = False
        self._waiting: set[Pending] = set()
        self._view = MetadataView(lambda: self._shell.table, self._shell.lock, self)
        self._claim: DirClaim | None = None
        self._vote_hold = VoteHold(held=False)

    @property
    def config(self) -> MetadataConfig:
        return self._config

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind, replay the journal, and start ticking. Raises MetadataUnavailableError if
        the address cannot be bound or the group was closed, ReplicationError if a restart
        from the journal would not be safe (see ``raft.check_restart_safe``); a second call
        is a no-op."""
        with self._state_lock:
            if self._closed:
                raise MetadataUnavailableError("metadata group is closed")
            if self._syncobj is not None:
                return
            check_restart_safe(self._config)
            journal_dir = self._config.journal_dir
            has_peers = bool(self._config.partner_addresses)
            if journal_dir is not None:
                self._claim = claim_dir(journal_dir, "metadata journal")
            try:
                if journal_dir is not None:
                    self._vote_hold.held = repair_journal(journal_dir, has_peers) and has_peers
                self._syncobj = SyncObj(
                    self._config.self_address,
                    list(self._config.partner_addresses),
                    conf=syncobj_conf(self._config),
                    consumers=[self._shell],
                    transportClass=functools.partial(GatedTransport, vote_hold=self._vote_hold),
                )
            except SyncObjException as exc:
                self._release_claim()
                raise MetadataUnavailableError(
                    f"cannot bind metadata replica at {self._config.self_address}: {exc}"
                ) from exc
            except BaseException:
                self._release_claim()
                raise
            self._thread = threading.Thread(
                target=self._tick_loop,
                name=f"kvflow-meta-{self._config.self_address}",
                daemon=True,
            )
            self._thread.start()
        logger.info(
            "metadata replica started: self=%s partners=%s journal=%s",
            self._config.self_address,
            ",".join(self._config.partner_addresses) or "-",
            self._config.journal_dir,
        )

    def wait_ready(self, timeout: float) -> None:
        """Block until a leader is known and this replica has applied what the leader had
        committed when it joined. Raises MetadataTimeoutError after ``timeout`` seconds."""
        syncobj = self._require_started()
        deadline = time.monotonic() + timeout
        while True:
            if syncobj.isReady() and syncobj._getLeader() is not None:
                return
            if time.monotonic() >= deadline:
                raise MetadataTimeoutError(
                    f"metadata replica {self._config.self_address} not ready after {timeout}s "
                    f"(leader: {self.leader() or 'none'})"
                )
            self._kick.set()
            time.sleep(0.01)

    def close(self) -> None:
        """Stop the tick thread, close sockets and the journal. Idempotent; never raises."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            syncobj, thread = self._syncobj, self._thread
        self._stop.set()
        self._kick.set()
        if thread is not None:
            thread.join()
        with self._state_lock:
            waiting, self._waiting = self._waiting, set()
        for pending in waiting:
            if not pending.done.is_set():
                pending(None, CLOSED)
        if syncobj is not None:
            try:
                syncobj.destroy()
            except Exception:
                logger.exception(
                    "metadata replica %s: error while closing", self._config.self_address
                )
        self._release_claim()
        if syncobj is not None:
            logger.info("metadata replica closed: self=%s", self._config.self_address)

    def _release_claim(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.release()

    def __enter__(self) -> MetadataGroup:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ writes

    def record_batch(
        self,
        node: NodeId,
        stored: Sequence[tuple[bytes, Tier]],
        removed: Sequence[bytes],
        now: float,
    ) -> None:
        """Record that ``node`` now holds ``stored`` and no longer holds ``removed``.

        One Raft entry for the whole batch as long as its keys fit in ``max_entry_bytes``
        (~58k 16-byte keys at the default 1 MiB, stores and removals counted together); a
        larger batch is split into consecutive entries, stores before removals, each applied
        atomically. An empty batch proposes nothing. Semantics as
        :meth:`MetadataTable.record_batch`.
        """
        check_node(node)
        keys, tiers = split_stored(stored)
        gone = check_keys(removed, "removed")
        now = check_now(now)
        if not keys and not gone:
            return
        syncobj = self._require_started()
        # Chunk stores and removals as one sequence, so a batch that fits is one entry.
        combined = keys + gone
        split = len(keys)
        proposals: list[Callable[[Pending], None]] = []
        for start, end in chunk_bounds(combined, self._config.max_entry_bytes):
            width, blob = pack_keys(combined[start : min(end, split)])
            removed_width, removed_blob = pack_keys(combined[max(start, split) : end])
            proposals.append(
                self._proposer(
                    self._shell.cmd_record,
                    node,
                    width,
                    blob,
                    tiers[start : min(end, split)],
                    removed_width,
                    removed_blob,
                    now,
                )
            )
        self._submit(syncobj, proposals)

    def replace_holdings(
        self, node: NodeId, holdings: Sequence[tuple[bytes, Tier]], now: float
    ) -> None:
        """Make ``holdings`` exactly what is recorded for ``node`` (node re-adoption/rebuild).

        Atomic when the keys fit in ``max_entry_bytes``. A larger set is split: the first
        entry clears the node and records the first chunk, the others add chunks; between
        them readers see part of the node's blocks (misses, never wrong holders). An empty
        ``holdings`` clears the node (one entry).
        """
        check_node(node)
        keys, tiers = split_stored(holdings)
        now = check_now(now)
        syncobj = self._require_started()
        proposals: list[Callable[[Pending], None]] = []
        for i, (start, end) in enumerate(chunk_bounds(keys, self._config.max_entry_bytes)):
            width, blob = pack_keys(keys[start:end])
            if i == 0:
                proposals.append(
                    self._proposer(
                        self._shell.cmd_replace, node, width, blob, tiers[start:end], now
                    )
                )
            else:
                proposals.append(
                    self._proposer(
                        self._shell.cmd_record, node, width, blob, tiers[start:end], 0, b"", now
                    )
                )
        self._submit(syncobj, proposals)

    def set_replica_target(self, key: bytes, n: int, now: float) -> None:
        """Set how many replicas ``key`` should have (``n >= 1``; 1 resets to the default).
        A target is dropped when the block's last replica goes."""
        check_key(key)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: replica target must be an int >= 1, got {n!r}")
        self._run_one(self._shell.cmd_target, key, n, check_now(now))

    def register_node(self, node: NodeId, address: str, kind: str, now: float) -> None:
        """Add ``node`` (or update its address and kind); counts as a heartbeat."""
        check_node(node)
        if not isinstance(address, str) or not isinstance(kind, str):
            raise TypeError("address and kind: expected str")
        self._run_one(self._shell.cmd_register, node, address, kind, check_now(now))

    def heartbeat(self, node: NodeId, now: float) -> bool:
        """Mark ``node`` alive at ``now``. Returns False if the metadata did not know the node
        (never registered, or reaped as dead): it is registered again with no blocks and
        should call :meth:`replace_holdings` with what it holds."""
        check_node(node)
        return bool(self._run_one(self._shell.cmd_heartbeat, node, check_now(now)))

    def reap_dead_nodes(self, now: float) -> list[NodeId]:
        """Drop every node whose last heartbeat is older than ``node_dead_after_s`` at
        ``now``, with all its replicas. Returns the dropped nodes, sorted. The threshold
        travels in the entry, so every replica drops the same nodes."""
        result = self._run_one(
            self._shell.cmd_reap, check_now(now), float(self._config.node_dead_after_s)
        )
        return [NodeId(node) for node in result or ()]

    def job_write(
        self,
        op: str,
        job_id: str,
        owner: str,
        now: float,
        *,
        doc: bytes = b"",
        events: Sequence[bytes] = (),
        lease_s: float = 0.0,
    ) -> bool:
        """One job command (``create``, ``claim``, ``append`` a batch of events, ``release``;
        replication/jobs.py says when each is granted). One Raft entry; whether it took."""
        check_job_write(op, job_id, owner, doc, events, lease_s, self._config.max_entry_bytes)
        return bool(
            self._run_one(
                self._shell.cmd_job,
                op,
                job_id,
                owner,
                bytes(doc),
                [bytes(e) for e in events],
                float(lease_s),
                check_now(now),
            )
        )

    def job_read(self, job_id: str = "") -> tuple[list[JobRecord], float]:
        """Every job's record (or ``job_id``'s) on this replica, and its clock (the same
        answer as ``RemoteMetadata.job_read``)."""
        return self._view.jobs(job_id), time.time()

    # ------------------------------------------------------------------ reads

    def view(self) -> MetadataView:
        """The read-only view of this replica's applied state (the same object each call)."""
        return self._view

    def is_leader(self) -> bool:
        """Whether this replica believes it is the leader (may be briefly stale)."""
        syncobj = self._syncobj
        return syncobj is not None and not self._closed and bool(syncobj._isLeader())

    def is_ready(self) -> bool:
        """Whether a leader is known and this replica has caught up (``wait_ready`` would
        return now). False when not started or closed."""
        syncobj = self._syncobj
        if syncobj is None or self._closed:
            return False
        return bool(syncobj.isReady()) and syncobj._getLeader() is not None

    def leader(self) -> str | None:
        """The leader's address as this replica knows it, or None."""
        syncobj = self._syncobj
        if syncobj is None or self._closed:
            return None
        node = syncobj._getLeader()
        return None if node is None else str(node.id)

    def raft_status(self) -> dict[str, Any]:
        """pysyncobj's debug status of this replica (log length, commit index, term...).
        Read from another thread than the tick thread, so values may be mid-update."""
        syncobj = self._require_started()
        for _ in range(10):
            try:
                return dict(syncobj.getStatus())
            except RuntimeError:  # a dict changed size under us on the tick thread; retry
                time.sleep(0.001)
        return dict(syncobj.getStatus())

    # ------------------------------------------------------------------ internals

    def _require_started(self) -> SyncObj:
        syncobj = self._syncobj
        if syncobj is None or self._closed:
            state = "closed" if self._closed else "not started"
            raise MetadataUnavailableError(f"metadata group is {state}")
        return syncobj

    @staticmethod
    def _proposer(method: Callable[..., Any], *args: Any) -> Callable[[Pending], None]:
        return lambda pending: method(*args, callback=pending)

    def _run_one(self, method: Callable[..., Any], *args: Any) -> Any:
        syncobj = self._require_started()
        return self._submit(syncobj, [self._proposer(method, *args)])

    def _submit(self, syncobj: SyncObj, proposals: list[Callable[[Pending], None]]) -> Any:
        """Propose entries in order (pipelined), wait for all; return the last result."""
        pendings: list[Pending] = []
        # Kick before proposing: proposing wakes the tick thread's poll, and the tick thread
        # must then see the kick, or it would go back to a full-period wait.
        self._kick.set()
        with self._state_lock:
            if self._closed:
                raise MetadataUnavailableError("metadata group is closed")
            for propose in proposals:
                pending = Pending()
                propose(pending)
                pendings.append(pending)
            self._waiting.update(pendings)
        self._kick.set()
        try:
            deadline = time.monotonic() + self._config.commit_timeout_s
            for pending in pendings:
                if not pending.done.wait(max(deadline - time.monotonic(), 0.0)):
                    raise MetadataTimeoutError(
                        f"metadata write not committed within {self._config.commit_timeout_s}s "
                        f"(leader: {self.leader() or 'none'})"
                    )
                raise_for(pending.error, self.leader)
        finally:
            with self._state_lock:
                self._waiting.difference_update(pendings)
        return pendings[-1].result if pendings else None

    def _tick_loop(self) -> None:
        """The only thread that ticks pysyncobj: applies entries, sends and receives."""
        syncobj = self._syncobj
        assert syncobj is not None
        period = self._config.tick_period_s
        fast_ticks = 0
        while not self._stop.is_set():
            if self._kick.is_set():
                self._kick.clear()
                fast_ticks = _FAST_TICKS
            try:
                syncobj.doTick(0.0 if fast_ticks else period)
            except Exception:
                logger.exception("metadata replica %s: tick failed", self._config.self_address)
                self._stop.wait(period)
            fast_ticks = max(fast_ticks - 1, 0)
            if self._vote_hold.held and syncobj.isReady():
                self._vote_hold.release(self._config.self_address)
