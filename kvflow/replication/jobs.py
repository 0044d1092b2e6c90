"""JobTable: durable records of background jobs (warm-up jobs) in the metadata group, so any
router can resume a job whose router died.

A job is an opaque definition (``doc``, written once), an append-only list of opaque events
(its progress) and an owner with a lease. Only the owner appends; another process takes the
job over by claiming it once the lease lapsed (``now`` of the claim past ``lease_until``), and
from then on the old owner's appends are refused (fencing: it learns it lost the job).

Pure and deterministic like :class:`MetadataTable` (``now`` is an argument; no I/O). Every
command is idempotent up to duplicates of events, which job events tolerate (replaying an
item result twice leaves the same job). Thread-safety: none (the shell's lock).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_JOB_ID = 64
MAX_OWNER = 256


@dataclass(slots=True)
class _Job:
    doc: bytes
    created_at: float
    owner: str = ""
    lease_until: float = 0.0
    events: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class JobRecord:
    """One job as read; ``events`` in append order."""

    job_id: str
    doc: bytes
    created_at: float
    owner: str
    lease_until: float
    events: tuple[bytes, ...]


JOB_OPS = ("create", "claim", "append", "release")


def check_job_write(
    op: str,
    job_id: str,
    owner: str,
    doc: bytes,
    events: Sequence[bytes],
    lease_s: float,
    max_bytes: int,
) -> None:
    """ValueError naming the argument for a job command that must not be proposed."""
    if op not in JOB_OPS:
        raise ValueError(f"op: one of {JOB_OPS}, got {op!r}")
    if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_JOB_ID:
        raise ValueError(f"job_id: 1-{MAX_JOB_ID} characters, got {job_id!r}")
    if not isinstance(owner, str) or not 0 < len(owner) <= MAX_OWNER:
        raise ValueError(f"owner: 1-{MAX_OWNER} characters, got {owner!r}")
    if op in ("create", "claim") and not (isinstance(lease_s, int | float) and lease_s > 0):
        raise ValueError(f"lease_s: must be > 0 for {op}, got {lease_s!r}")
    size = len(doc) + sum(len(e) for e in events)
    if size > max_bytes:
        raise ValueError(f"doc and events: {size} bytes, over one entry's {max_bytes}")


class JobTable:
    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}

    # -- commands -----------------------------------------------------------------------------
    def create(self, job_id: str, doc: bytes, owner: str, lease_s: float, now: float) -> bool:
        """Add a job owned by ``owner`` until ``now + lease_s``; False (nothing changed) when
        the id exists."""
        if job_id in self._jobs:
            return False
        self._jobs[job_id] = _Job(bytes(doc), now, owner, now + lease_s)
        return True

    def claim(self, job_id: str, owner: str, lease_s: float, now: float) -> bool:
        """Own the job until ``now + lease_s``: granted to its owner (a renewal) or to anyone
        when it has none or its lease lapsed. False: unknown job or another's live lease."""
        job = self._jobs.get(job_id)
        if job is None:
            return False
        if job.owner and job.owner != owner and now < job.lease_until:
            return False
        renew = job.owner == owner
        job.owner = owner
        job.lease_until = max(job.lease_until if renew else 0.0, now + lease_s)
        return True

    def append(self, job_id: str, owner: str, events: Sequence[bytes]) -> bool:
        """Append ``events`` when ``owner`` owns the job (even past its lease, while nobody
        claimed it); False otherwise (nothing changed)."""
        job = self._jobs.get(job_id)
        if job is None or job.owner != owner:
            return False
        job.events.extend(bytes(e) for e in events)
        return True

    def release(self, job_id: str, owner: str) -> bool:
        """Give the job up (anyone may claim it at once); False when ``owner`` does not own it."""
        job = self._jobs.get(job_id)
        if job is None or job.owner != owner:
            return False
        job.owner, job.lease_until = "", 0.0
        return True

    # -- reads --------------------------------------------------------------------------------
    def ids(self) -> list[str]:
        return sorted(self._jobs, key=lambda j: (self._jobs[j].created_at, j))

    def record(self, job_id: str) -> JobRecord | None:
        job = self._jobs.get(job_id)
        if job is None:
            return None
        return JobRecord(
            job_id, job.doc, job.created_at, job.owner, job.lease_until, tuple(job.events)
        )

    # -- snapshot -----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            j: (x.doc, x.created_at, x.owner, x.lease_until, x.events)
            for j, x in self._jobs.items()
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        self._jobs = {j: _Job(*fields) for j, fields in snapshot.items()}
