"""The router's configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.router.policies.registry import policy_names


@dataclass(frozen=True)
class RouterConfig:
    """Conductor settings. Every field is validated; ValueError names the field.

    Fields:
        policy: registered policy name (``kvflow.router.policies.policy_names()``).
        ttft_slo_s: time-to-first-token SLO in seconds; None disables TTFT rejection.
        tbt_slo_s: time-between-tokens SLO in seconds; None disables TBT rejection.
        balancing_threshold: the paper's ``kvcache_balancing_threshold``, a *ratio* >= 1. An
            instance whose local prefix is ``L`` blocks considers pulling the best match of
            ``B`` blocks from its holder only when ``B > balancing_threshold * L`` (strictly;
            written as a product so that ``L = 0`` needs no special case). 1.0 pulls whenever
            any longer match exists.
        block_size: tokens per block.
        block_nbytes: bytes of one block's KV (all layers, K and V): what a pull moves per block.
        seed: seed of the rng that random policies draw from.
    """

    policy: str = "cache-aware"
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    balancing_threshold: float = 2.0
    block_size: int = 64
    block_nbytes: int = 1 << 20
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in policy_names():
            raise ValueError(f"policy must be one of {policy_names()}, got {self.policy!r}")
        for name in ("ttft_slo_s", "tbt_slo_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")
        if not (math.isfinite(self.balancing_threshold) and self.balancing_threshold >= 1.0):
            raise ValueError(
                "balancing_threshold must be a finite ratio >= 1.0, "
                f"got {self.balancing_threshold!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size!r}")
        if self.block_nbytes < 1:
            raise ValueError(f"block_nbytes must be >= 1, got {self.block_nbytes!r}")
