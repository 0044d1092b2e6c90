"""The records of a warm-up job: its options (budget, replicas, pin), its state and each
item's result. Plain data, JSON round-trips for the job store."""

from __future__ import annotations

import enum
import re
from dataclasses import asdict, dataclass, field
from typing import Any

ON_LIMIT = ("stop", "skip", "truncate")
_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (JobState.DONE, JobState.CANCELLED, JobState.FAILED)


class ItemState(enum.Enum):
    PENDING = "pending"
    WARMED = "warmed"  # computed by this job (some blocks may have been cached already)
    CACHED = "cached"  # every full block was cached before: nothing computed
    TRUNCATED = "truncated"  # warmed up to the budget's limit only
    OVER_BUDGET = "over_budget"  # left out: it did not fit the budget
    ERROR = "error"  # bad item (over the model length, template error) or failed attempts

    @property
    def finished(self) -> bool:
        return self is not ItemState.PENDING


@dataclass(frozen=True)
class Budget:
    """The most a job may add to the cache. ``max_blocks``/``max_bytes``: 0 = no limit; both
    count the distinct new blocks the job computes (they land in DRAM; demotion may move them
    to SSD later; replica copies are not counted). ``on_limit``: ``stop`` the job, ``skip``
    items that do not fit (smaller ones may still), or ``truncate`` an item to the leading
    blocks that fit."""

    max_blocks: int = 0
    max_bytes: int = 0
    on_limit: str = "stop"

    def __post_init__(self) -> None:
        if self.max_blocks < 0:
            raise ValueError(f"budget.max_blocks must be >= 0, got {self.max_blocks}")
        if self.max_bytes < 0:
            raise ValueError(f"budget.max_bytes must be >= 0, got {self.max_bytes}")
        if self.on_limit not in ON_LIMIT:
            raise ValueError(f"budget.on_limit must be one of {ON_LIMIT}, got {self.on_limit!r}")

    def limit_blocks(self, block_nbytes: int) -> int | None:
        """The most blocks allowed (None: unlimited); ValueError when below one block."""
        limits = []
        if self.max_blocks:
            limits.append(self.max_blocks)
        if self.max_bytes:
            limits.append(self.max_bytes // block_nbytes)
        if not limits:
            return None
        if min(limits) < 1:
            raise ValueError(
                f"budget of {self.max_bytes} bytes is smaller than one block ({block_nbytes} bytes)"
            )
        return min(limits)


@dataclass(frozen=True)
class JobOptions:
    """``tenant``: the namespace blocks are warmed in (decided by ``api.warmup.job_tenant``).
    ``replicas``: replica target for the warmed blocks (0 = leave as is). ``pin_ttl_s``: pin
    the warmed blocks for this long (0 = no pin). ``segment_blocks``: an item is computed in
    segments of this many blocks, each a separate background request, so online requests wait
    behind at most one segment. ``max_attempts``: tries per segment before the item fails."""

    tenant: str = "default"
    budget: Budget = field(default_factory=Budget)
    replicas: int = 0
    pin_ttl_s: float = 0.0
    segment_blocks: int = 4
    max_attempts: int = 3
    format: str = "auto"

    def __post_init__(self) -> None:
        if not _TENANT.match(self.tenant):
            raise ValueError(f"tenant must be 1-64 of [A-Za-z0-9_.-], got {self.tenant!r}")
        if not 0 <= self.replicas <= 64:
            raise ValueError(f"replicas must be in [0, 64], got {self.replicas}")
        if self.pin_ttl_s < 0:
            raise ValueError(f"pin_ttl_s must be >= 0, got {self.pin_ttl_s}")
        if not 1 <= self.segment_blocks <= 1024:
            raise ValueError(f"segment_blocks must be in [1, 1024], got {self.segment_blocks}")
        if not 1 <= self.max_attempts <= 20:
            raise ValueError(f"max_attempts must be in [1, 20], got {self.max_attempts}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> JobOptions:
        return cls(**{**doc, "budget": Budget(**doc.get("budget", {}))})


@dataclass
class ItemResult:
    """What the job did with one item. Blocks are full blocks of the item's prompt."""

    index: int
    state: ItemState = ItemState.PENDING
    tokens: int = 0
    blocks_total: int = 0
    blocks_cached_before: int = 0
    blocks_warmed: int = 0
    instance: str = ""
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ItemResult:
        return cls(**{**doc, "state": ItemState(doc["state"])})
