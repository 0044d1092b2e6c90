"""Guards around a replica's journal directory, for restarts that are safe by construction.

A replica restarts from its own journal under its own Raft address; pysyncobj (>= 0.3.17)
then restores its log, ``currentTerm`` and ``votedFor`` and catches up from the leader (see
README.md, "Restarts"). Two mistakes would break Raft's guarantees, and these guards refuse
them before the replica binds:

* two live processes on one journal (``LOCK``, an exclusive ``flock`` held while the
  process lives; the OS drops it when the process dies, even by SIGKILL);
* a journal reused under another address or another member list (``group.json`` records
  both at first start; a journal belongs to one identity in one group).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvflow.replication.dir_guard import LOCK_FILE, DirClaim, claim_dir
from kvflow.replication.errors import ReplicationError

__all__ = ["IDENTITY_FILE", "LOCK_FILE", "JournalClaim", "claim_journal_dir"]

IDENTITY_FILE = "group.json"


class JournalClaim:
    """Holds the journal directory's lock until :meth:`release` (idempotent) or process
    exit. One per replica process."""

    def __init__(self, claim: DirClaim, journal_dir: Path) -> None:
        self._claim = claim
        self.journal_dir = journal_dir

    def release(self) -> None:
        self._claim.release()


def claim_journal_dir(
    journal_dir: Path, self_address: str, partner_addresses: tuple[str, ...]
) -> JournalClaim:
    """Create ``journal_dir`` if needed, lock it, and check (or record, the first time) the
    replica's identity. Raises ReplicationError naming the directory when it is locked by a
    live process (and that process's pid) or belongs to another address or member list;
    nothing is changed then."""
    claim = claim_dir(journal_dir, "metadata journal")
    try:
        _check_identity(journal_dir, self_address, partner_addresses)
    except BaseException:
        claim.release()
        raise
    return JournalClaim(claim, journal_dir)


def _check_identity(journal_dir: Path, self_address: str, partners: tuple[str, ...]) -> None:
    wanted = {"self_address": self_address, "members": sorted((self_address, *partners))}
    path = journal_dir / IDENTITY_FILE
    if path.exists():
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ReplicationError(
                f"journal {journal_dir}: unreadable {IDENTITY_FILE}: {exc}"
            ) from exc
        if recorded != wanted:
            raise ReplicationError(
                f"journal {journal_dir} belongs to replica {recorded.get('self_address')} of "
                f"group {recorded.get('members')}, not {self_address} of {wanted['members']}; "
                "use another directory for a new identity"
            )
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(wanted))
    os.replace(tmp, path)
