"""Configuration of the remote read path: the holder's block service and the reader's client."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.kvdb.remote.peer_budget import PeerCallBudget


@dataclass(frozen=True)
class BlockServiceConfig:
    """Knobs of a holder's BlockService (``kvflow.kvdb.remote.server``).

    lease_timeout_s: a lease not released within this many seconds is dropped and its pins
        released (a dead reader must not pin blocks forever). Keep it above the readers'
        transfer ``request_timeout_s``: a read that outlives its lease may find its extent
        reused, which its checksum then reports as a miss.
    max_keys: the most keys one Lease may name.
    promote: lease SSD-only blocks by reading them into DRAM first; False = a lease stops at
        the first block that is not already in DRAM.
    reap_interval_s: how often the background reaper drops expired leases (they are also
        dropped at every Lease call).
    """

    lease_timeout_s: float = 60.0
    max_keys: int = 65536
    promote: bool = True
    reap_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.lease_timeout_s > 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {self.lease_timeout_s}")
        if not isinstance(self.max_keys, int) or self.max_keys < 1:
            raise ValueError(f"max_keys must be an int >= 1, got {self.max_keys!r}")
        if not self.reap_interval_s > 0:
            raise ValueError(f"reap_interval_s must be > 0, got {self.reap_interval_s}")


@dataclass(frozen=True)
class RemoteClientConfig:
    """Knobs of a reader's RemoteClient (``kvflow.kvdb.remote.reader``).

    budget: the deadlines of its calls, sized to the bytes (a Lease: base + the bytes asked
        for, which the holder may promote from SSD; a read: base + the leased bytes; a
        Release: base), and the config of the holder's circuit breaker
        (``kvflow.kvdb.remote.peer_budget``).
    staging_bytes: size of the registered staging buffer used for destinations that are not
        inside a registered region (grown to the largest single block if smaller).
    """

    budget: PeerCallBudget = field(default_factory=PeerCallBudget)
    staging_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.budget, PeerCallBudget):
            raise ValueError(f"budget must be a PeerCallBudget, got {self.budget!r}")
        if not isinstance(self.staging_bytes, int) or self.staging_bytes < 1:
            raise ValueError(f"staging_bytes must be an int >= 1, got {self.staging_bytes!r}")
