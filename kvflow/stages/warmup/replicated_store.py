"""MetadataJobStore: a JobStore whose records live in the metadata group (replication/jobs.py),
so any router can show every job and resume one whose router died.

A job is one record: its definition (``store.job_doc`` as zlib-compressed JSON, written once)
and its events (JSON, appended). Only the owner appends; it holds a lease that a background
thread renews every ``lease_s / 3``. When a router dies its lease lapses after ``lease_s`` and
another router claims the job, replays its events and runs the items still pending; the dead
router's late appends would be refused (fencing), and a router that finds its appends or
renewals refused reports the job ``lost`` and stops it.

Appends are batched: ``append`` only buffers; the thread writes each job's buffer as one Raft
entry every ``flush_s``. So a router killed mid-job loses at most ``flush_s`` of results: those
items run again on the next owner (their blocks are cached by then, so they cost a lookup).

``meta`` is a ``MetadataGroup`` (in process) or a ``RemoteMetadata``: both have ``job_write``
and ``job_read``. Thread-safe.
"""

from __future__ import annotations

import json
import logging
import threading
import zlib
from typing import Any

from kvflow.stages.warmup.store import StoredJob, job_doc, job_from_doc, replay

logger = logging.getLogger(__name__)

LEASE_S = 5.0
FLUSH_S = 0.2
MAX_APPEND_BYTES = 256 << 10  # per Raft entry; a larger buffer goes in several


class MetadataJobStore:
    shared = True

    def __init__(
        self, meta: Any, owner: str, lease_s: float = LEASE_S, flush_s: float = FLUSH_S
    ) -> None:
        if not owner:
            raise ValueError("owner must name this process")
        self._meta = meta
        self.owner = owner
        self.lease_s = lease_s
        self._flush_s = flush_s
        self._lock = threading.Lock()
        self._io = threading.Lock()  # one writer at a time keeps each job's events in order
        self._buffers: dict[str, list[bytes]] = {}
        self._owned: set[str] = set()
        self._lost: set[str] = set()
        self._claimable: dict[str, bool] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvflow-warmup-jobs", daemon=True)
        self._thread.start()

    # -- JobStore -------------------------------------------------------------------------------
    def create(self, job: StoredJob) -> None:
        doc = zlib.compress(json.dumps(job_doc(job)).encode())
        if not self._meta.job_write(
            "create", job.job_id, self.owner, doc=doc, lease_s=self.lease_s
        ) and not self._created_by_me(job.job_id, doc):
            raise ValueError(f"job {job.job_id} exists already")
        with self._lock:
            self._owned.add(job.job_id)

    def _created_by_me(self, job_id: str, doc: bytes) -> bool:
        """A create refused because an earlier attempt of the same call took (a client retry
        after a lost answer) is a success: the record is this owner's, with this doc."""
        records, _ = self._meta.job_read(job_id)
        return any(r.owner == self.owner and r.doc == doc for r in records)

    def append(self, job_id: str, event: dict[str, Any]) -> None:
        with self._lock:
            if job_id not in self._lost:
                self._buffers.setdefault(job_id, []).append(json.dumps(event).encode())

    def load_all(self) -> list[StoredJob]:
        records, now = self._meta.job_read()
        jobs = []
        claimable = {}
        for r in records:
            try:
                job = job_from_doc(json.loads(zlib.decompress(r.doc)))
            except (zlib.error, ValueError, KeyError, TypeError) as exc:
                logger.warning("warm-up job=%s unreadable, skipped: %s", r.job_id, exc)
                continue
            replay(job, list(r.events))
            jobs.append(job)
            claimable[r.job_id] = r.owner in ("", self.owner) or r.lease_until <= now
        with self._lock:
            self._claimable = claimable
        return jobs

    def claim(self, job_id: str) -> bool:
        ok = bool(self._meta.job_write("claim", job_id, self.owner, lease_s=self.lease_s))
        with self._lock:
            if ok:
                self._owned.add(job_id)
                self._lost.discard(job_id)
        return ok

    def claimable(self, job_id: str) -> bool:
        with self._lock:
            return self._claimable.get(job_id, False)

    def lost(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._lost

    def release(self, job_id: str) -> None:
        self.flush()
        with self._lock:
            owned = job_id in self._owned
            self._owned.discard(job_id)
        if owned:
            self._meta.job_write("release", job_id, self.owner)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        with self._lock:
            owned = list(self._owned)
        for job_id in owned:
            try:
                self.release(job_id)
            except Exception:
                logger.warning("warm-up job=%s: release at close failed", job_id, exc_info=True)

    # -- background -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Write every buffered event (one entry per job and ``MAX_APPEND_BYTES``); a job
        whose append is refused is lost. Raises what the metadata raises (buffers kept)."""
        with self._io:
            with self._lock:
                pending = {j: b for j, b in self._buffers.items() if b}
            for job_id, events in pending.items():
                for batch in _batches(events):
                    if not self._meta.job_write("append", job_id, self.owner, events=batch):
                        self._mark_lost(job_id)
                        break
                    with self._lock:
                        del self._buffers[job_id][: len(batch)]

    def _renew(self) -> None:
        with self._lock:
            owned = list(self._owned)
        for job_id in owned:
            if not self._meta.job_write("claim", job_id, self.owner, lease_s=self.lease_s):
                self._mark_lost(job_id)

    def _mark_lost(self, job_id: str) -> None:
        logger.warning("warm-up job=%s: another router took it over", job_id)
        with self._lock:
            self._lost.add(job_id)
            self._owned.discard(job_id)
            self._buffers.pop(job_id, None)

    def _loop(self) -> None:
        renew_every = max(1, round(self.lease_s / 3 / self._flush_s))
        n = 0
        while not self._stop.wait(self._flush_s):
            n += 1
            try:
                self.flush()
                if n % renew_every == 0:
                    self._renew()
            except Exception as exc:  # the metadata is unavailable: try again next period
                logger.warning("warm-up jobs: metadata write failed, retrying: %s", exc)
        try:
            self.flush()
        except Exception as exc:
            logger.warning("warm-up jobs: last flush failed: %s", exc)


def _batches(events: list[bytes]) -> list[list[bytes]]:
    out: list[list[bytes]] = [[]]
    size = 0
    for e in events:
        if out[-1] and size + len(e) > MAX_APPEND_BYTES:
            out.append([])
            size = 0
        out[-1].append(e)
        size += len(e)
    return out
