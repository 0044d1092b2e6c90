"""Configuration of one replica of the metadata group."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.security import process_secret

JOURNAL_FILE = "raft.journal"
"""File name of the Raft log inside ``journal_dir`` (pysyncobj adds ``.meta`` beside it)."""
DUMP_FILE = "raft.dump"
"""File name of the compacted full state inside ``journal_dir``."""


def check_address(field: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: expected 'host:port' with a port in 1..65535, got {address!r}")


@dataclass(frozen=True)
class MetadataConfig:
    """One replica of the Raft metadata group (pysyncobj underneath).

    Every replica of a group lists the same set of addresses: its own ``self_address`` plus
    the others in ``partner_addresses``. ``journal_dir`` belongs to exactly one replica.
    """

    self_address: str
    """This replica's Raft endpoint, ``"host:port"`` (bound on that host)."""
    partner_addresses: tuple[str, ...] = ()
    """The other replicas' endpoints; empty for a single replica (the embedded store)."""
    journal_dir: Path | None = None
    """Directory of this replica's Raft log and state dump; ``None`` keeps both in memory
    (state is lost on close; for tests)."""
    commit_timeout_s: float = 5.0
    """How long a write waits for its Raft entry to be committed and applied."""
    node_dead_after_s: float = 10.0
    """A node whose last heartbeat is older than this is dropped by ``reap_dead_nodes``."""
    max_entry_bytes: int = 1 << 20
    """Upper bound of the key bytes carried by one Raft entry; larger writes are split."""
    append_entries_period_s: float = 0.05
    """Leader heartbeat (append_entries) interval."""
    raft_min_timeout_s: float = 0.4
    """Lower bound of the randomized election timeout; more than 3x the append period."""
    raft_max_timeout_s: float = 1.2
    """Upper bound of the randomized election timeout."""
    connection_retry_s: float = 0.5
    """Interval between reconnection attempts to an unreachable partner."""
    tick_period_s: float = 0.02
    """The tick thread's longest wait for network events between Raft ticks."""
    bind_retries: int = 10
    """Attempts to bind ``self_address`` (``bind_retry_s`` apart) before ``start`` fails."""
    bind_retry_s: float = 0.2
    """Seconds between bind attempts."""
    log_compaction_min_entries: int = 5000
    """Compact the Raft log into a state dump once it holds this many entries..."""
    log_compaction_min_time_s: float = 300.0
    """... or this long after the previous compaction."""
    password: str | None = field(default_factory=lambda: _process_raft_password(), repr=False)
    """pysyncobj's password: every Raft message is encrypted and authenticated with it
    (Fernet), so nothing reaches ``pickle.loads`` without it. Default: derived from this
    process's cluster secret (``KVFLOW_CLUSTER_SECRET_FILE``); a lone replica (no
    partners) without one gets a random password; a replica with partners refuses ``None``
    (a group never runs open: pysyncobj unpickles what its port receives)."""

    def __post_init__(self) -> None:
        check_address("self_address", self.self_address)
        if self.password is None and not self.partner_addresses:
            # A lone replica talks to nobody: a random password closes its Raft port to all.
            object.__setattr__(self, "password", secrets.token_hex(16))
        if not isinstance(self.partner_addresses, tuple):
            raise ValueError("partner_addresses: must be a tuple of 'host:port' strings")
        for address in self.partner_addresses:
            check_address("partner_addresses", address)
        if self.self_address in self.partner_addresses:
            raise ValueError("partner_addresses: must not contain self_address")
        if self.password is None:
            raise ValueError(
                "password: a metadata replica with partners needs the cluster secret "
                "(--cluster-secret-file or KVFLOW_CLUSTER_SECRET_FILE)"
            )
        if not isinstance(self.password, str) or not self.password:
            raise ValueError("password: must be a non-empty string")
        if len(set(self.partner_addresses)) != len(self.partner_addresses):
            raise ValueError("partner_addresses: contains duplicates")
        if self.journal_dir is not None and not isinstance(self.journal_dir, Path):
            raise ValueError("journal_dir: must be a pathlib.Path or None")
        self._check_positive()
        if self.raft_min_timeout_s <= 3 * self.append_entries_period_s:
            raise ValueError("raft_min_timeout_s: must exceed 3 * append_entries_period_s")
        if self.raft_max_timeout_s <= self.raft_min_timeout_s:
            raise ValueError("raft_max_timeout_s: must exceed raft_min_timeout_s")
        if self.max_entry_bytes < 1024:
            raise ValueError("max_entry_bytes: must be at least 1024")
        if self.bind_retries < 1:
            raise ValueError("bind_retries: must be at least 1")
        if self.log_compaction_min_entries < 2:
            raise ValueError("log_compaction_min_entries: must be at least 2")

    def _check_positive(self) -> None:
        for name in (
            "commit_timeout_s",
            "node_dead_after_s",
            "append_entries_period_s",
            "raft_min_timeout_s",
            "raft_max_timeout_s",
            "connection_retry_s",
            "tick_period_s",
            "bind_retry_s",
            "log_compaction_min_time_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")

    @property
    def journal_path(self) -> Path | None:
        """The Raft log file, or ``None`` for an in-memory journal."""
        return None if self.journal_dir is None else self.journal_dir / JOURNAL_FILE

    @property
    def dump_path(self) -> Path | None:
        """The compacted state file, or ``None`` for an in-memory journal."""
        return None if self.journal_dir is None else self.journal_dir / DUMP_FILE

    @property
    def num_replicas(self) -> int:
        """Size of the group: this replica plus its partners."""
        return 1 + len(self.partner_addresses)


def _process_raft_password() -> str | None:
    secret = process_secret()
    return None if secret is None else secret.raft_password()
