"""Durable job state on local disk: one directory per job under ``root``.

``job.json`` (written once, atomically): the options, the parsed items and the parse errors.
``events.jsonl`` (appended, flushed and fsynced per line): item results and state changes. A
job is rebuilt by replaying its events, so a process that restarts on the same ``root`` resumes
every unfinished job without redoing the items it finished. A torn last line (a crash while
appending) is ignored.

Covered: a restart of the process that owns ``root`` (the embedded server's data dir). Another
process taking a job over is ``MetadataJobStore``'s (replicated_store.py: the records live in
the metadata group; routers use it). Both are ``JobStore``s.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvflow.stages.warmup.corpus import CorpusError, CorpusItem
from kvflow.stages.warmup.job import ItemResult, JobOptions, JobState

logger = logging.getLogger(__name__)


@dataclass
class StoredJob:
    """A job as the store rebuilds it."""

    job_id: str
    options: JobOptions
    items: list[CorpusItem]
    errors: list[CorpusError]
    created_at: float
    state: JobState = JobState.QUEUED
    stopped_reason: str = ""
    results: dict[int, ItemResult] = field(default_factory=dict)
    runs: int = 0  # how many times a process started (or resumed) it


class JobStore(Protocol):
    """Where a manager keeps its jobs. Methods marked blocking run in a thread.

    ``shared``: other processes may run this store's jobs; the manager then claims a job
    before running it (``claim``), re-reads the store to show and adopt the others' jobs, and
    stops a job it ``lost`` (another process claimed it after this one's lease lapsed).
    """

    shared: bool

    def create(self, job: StoredJob) -> None:
        """Blocking. Persist a new job (this process owns it)."""
        ...

    def append(self, job_id: str, event: dict[str, Any]) -> None:
        """Record one event (durable now, or within a flush period for a shared store)."""
        ...

    def load_all(self) -> list[StoredJob]:
        """Blocking. Every job, oldest first."""
        ...

    def claim(self, job_id: str) -> bool:
        """Blocking. Whether this process may run the job now."""
        ...

    def claimable(self, job_id: str) -> bool:
        """As of the last ``load_all``: nobody else holds a live claim on the job."""
        ...

    def lost(self, job_id: str) -> bool:
        """Another process took the job over: stop running it."""
        ...

    def release(self, job_id: str) -> None:
        """Blocking. Write what is buffered and give the job up (a final job or at stop)."""
        ...

    def close(self) -> None:
        """Blocking. Write what is buffered, give up every job, stop background work."""
        ...


class FileJobStore:
    """A JobStore on local disk, for one process. Thread-safe. ``create`` then ``append``
    events; ``load_all`` at start."""

    shared = False

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def create(self, job: StoredJob) -> None:
        d = self.root / job.job_id
        d.mkdir(parents=True, exist_ok=False)
        doc = job_doc(job)
        tmp = d / "job.json.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, d / "job.json")

    def append(self, job_id: str, event: dict[str, Any]) -> None:
        line = json.dumps(event) + "\n"
        with self._lock, open(self.root / job_id / "events.jsonl", "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def claim(self, job_id: str) -> bool:
        return True

    def claimable(self, job_id: str) -> bool:
        return True

    def lost(self, job_id: str) -> bool:
        return False

    def release(self, job_id: str) -> None:
        pass

    def close(self) -> None:
        pass

    def load_all(self) -> list[StoredJob]:
        jobs = []
        for d in sorted(self.root.iterdir()):
            if not (d / "job.json").is_file():
                continue
            try:
                jobs.append(self._load(d))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("warm-up job dir=%s unreadable, skipped: %s", d, exc)
        jobs.sort(key=lambda j: j.created_at)
        return jobs

    def _load(self, d: Path) -> StoredJob:
        doc = json.loads((d / "job.json").read_text())
        job = job_from_doc(doc)
        events = d / "events.jsonl"
        if events.is_file():
            replay(job, events.read_text().splitlines())
        return job


def job_doc(job: StoredJob) -> dict[str, Any]:
    """A job's definition as plain data (written once)."""
    return {
        "job_id": job.job_id,
        "options": job.options.to_dict(),
        "items": [i.to_dict() for i in job.items],
        "errors": [[e.source, e.line, e.message] for e in job.errors],
        "created_at": job.created_at,
    }


def job_from_doc(doc: dict[str, Any]) -> StoredJob:
    return StoredJob(
        job_id=doc["job_id"],
        options=JobOptions.from_dict(doc["options"]),
        items=[CorpusItem.from_dict(i) for i in doc["items"]],
        errors=[CorpusError(s, int(n), m) for s, n, m in doc["errors"]],
        created_at=float(doc["created_at"]),
    )


def replay(job: StoredJob, lines: list[str] | list[bytes]) -> None:
    """Apply JSON event lines in order; a torn or bad line is logged and skipped."""
    for raw in lines:
        try:
            apply_event(job, json.loads(raw))
        except (json.JSONDecodeError, KeyError, ValueError):
            logger.warning("job=%s: a torn event line ignored", job.job_id)


def apply_event(job: StoredJob, event: dict[str, Any]) -> None:
    """Apply one event to ``job`` (the same function for live updates and replay)."""
    kind = event["kind"]
    if kind == "item":
        result = ItemResult.from_dict(event["result"])
        job.results[result.index] = result
    elif kind == "state":
        job.state = JobState(event["state"])
        job.stopped_reason = event.get("reason", job.stopped_reason)
    elif kind == "run":
        job.runs += 1
    else:
        raise ValueError(f"unknown event kind {kind!r}")
