"""Directories on disk that one process owns: a lock held for the process's life, and
damaged files moved aside for the operator.

* ``claim_dir`` takes an exclusive ``flock`` on ``<dir>/LOCK`` and writes the holder's pid
  into it; a second process is refused with a message naming the directory and that pid. The
  OS drops the lock when the process dies (SIGKILL included), so a stale ``LOCK`` file never
  blocks a restart. Claims within one process are counted (a replica's journal is claimed by
  the meta tool and again by its group), since an ``flock`` on a second open file description
  would refuse the process itself.
* ``move_aside`` renames a damaged file or directory to ``<name>.damaged-<UTC time>`` beside
  it: kept for a person to look at, out of the way of a fresh start.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path
from typing import IO

from kvflow.replication.errors import ReplicationError

LOCK_FILE = "LOCK"

_held: dict[Path, tuple[IO[str], int]] = {}
_held_lock = threading.Lock()


class DirInUseError(ReplicationError):
    """The directory is locked by another live process."""


class DirClaim:
    """One claim on a directory; :meth:`release` (idempotent) drops it, and the lock goes
    when the process's last claim on the directory is released (or the process exits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._released = False

    def release(self) -> None:
        with _held_lock:
            if self._released:
                return
            self._released = True
            handle, count = _held[self.path]
            if count > 1:
                _held[self.path] = (handle, count - 1)
                return
            del _held[self.path]
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def claim_dir(directory: Path, what: str) -> DirClaim:
    """Create ``directory`` if needed and lock it for this process. Raises DirInUseError
    ("<what> <dir> is in use by process <pid>") when another live process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    key = directory.resolve()
    with _held_lock:
        if key in _held:
            handle, count = _held[key]
            _held[key] = (handle, count + 1)
            return DirClaim(key)
        handle = open(key / LOCK_FILE, "a+")  # noqa: SIM115 - held for the process life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise DirInUseError(
                f"{what} {directory} is in use by process {holder} (lock {key / LOCK_FILE}); "
                "stop that process or use another directory"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        _held[key] = (handle, 1)
        return DirClaim(key)


def move_aside(path: Path) -> Path:
    """Rename ``path`` (a file or a directory) to ``<name>.damaged-<UTC time>`` in the same
    directory and return the new path (a numeric suffix keeps two moves in one second
    apart)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    os.replace(path, target)
    return target
