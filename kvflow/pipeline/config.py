"""Configuration of the stage runtime."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class PipelineConfig:
    """How a ``Pipeline`` schedules its stages. Immutable; validated on construction.

    Attributes:
        queue_size: capacity of the bounded queue in front of every stage (>= 1). When the first
            queue is full, ``submit`` awaits and ``try_submit`` raises ``Overloaded``; a full
            queue between stages holds the previous stage's worker (backpressure).
        default_concurrency: how many requests may be inside one stage at once when neither the
            stage nor ``stage_concurrency`` says otherwise (>= 1).
        stage_concurrency: per-stage override, stage name -> limit (each >= 1). Takes precedence
            over ``Stage.concurrency``. Stored as a read-only mapping.
        trace_capacity: how many finished request traces the default ``Tracer`` keeps (>= 1).
        default_deadline_s: deadline given at submission to a request that has none, in seconds
            from submission; ``None`` means no deadline.
        cleanup_timeout_s: the most one ``Stage.cleanup`` call may take before it is abandoned
            (> 0).
    """

    queue_size: int = 64
    default_concurrency: int = 8
    stage_concurrency: Mapping[str, int] = field(default_factory=dict)
    trace_capacity: int = 1024
    default_deadline_s: float | None = None
    cleanup_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _require_int("queue_size", self.queue_size)
        _require_int("default_concurrency", self.default_concurrency)
        _require_int("trace_capacity", self.trace_capacity)
        if not isinstance(self.stage_concurrency, Mapping):
            raise ValueError("stage_concurrency must be a mapping of stage name to int >= 1")
        for name, limit in self.stage_concurrency.items():
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"stage_concurrency: stage names must be non-empty str, got {name!r}"
                )
            _require_int(f"stage_concurrency[{name!r}]", limit)
        object.__setattr__(
            self, "stage_concurrency", MappingProxyType(dict(self.stage_concurrency))
        )
        if self.default_deadline_s is not None:
            _require_positive_float("default_deadline_s", self.default_deadline_s)
        _require_positive_float("cleanup_timeout_s", self.cleanup_timeout_s)

    def concurrency_for(self, stage_name: str, stage_default: int | None) -> int:
        """The concurrency limit of a stage: override, else the stage's own, else the default."""
        if stage_name in self.stage_concurrency:
            return self.stage_concurrency[stage_name]
        if stage_default is not None:
            return stage_default
        return self.default_concurrency


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _require_positive_float(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
