"""Errors raised by the replicated metadata group.

Every error of this package derives from :class:`ReplicationError`. Bad arguments are
``ValueError``/``TypeError`` naming the argument; the classes here are for failures of the
group itself (no leader, no commit in time, not started).
"""

from __future__ import annotations


class ReplicationError(Exception):
    """Base class of every failure of the metadata group."""


class NotLeaderError(ReplicationError):
    """The command was not committed because leadership changed while it was in flight.

    ``leader_hint`` is the address ("host:port") of the replica this one believes is the
    leader now, or ``None`` when it knows of none. The outcome of the command is unknown;
    every metadata command is idempotent, so retrying it is safe.
    """

    def __init__(self, leader_hint: str | None, detail: str = "") -> None:
        self.leader_hint = leader_hint
        message = f"not the leader (leader hint: {leader_hint or 'unknown'})"
        if detail:
            message = f"{message}: {detail}"
        super().__init__(message)


class MetadataUnavailableError(ReplicationError):
    """The group cannot take commands: not started, closed, no leader, or queue full."""


class MetadataTimeoutError(ReplicationError):
    """A command or ``wait_ready`` did not complete within its timeout.

    For a command the outcome is unknown (it may still commit later); commands are
    idempotent, so retrying is safe.
    """
