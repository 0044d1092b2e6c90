"""Typed records of routing: the request, per-instance predictions, the decision, the rejection.

All frozen values; a rejection is a result, not an exception (the server maps it to gRPC
RESOURCE_EXHAUSTED with :meth:`Rejection.message` as the details).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class RouteRequest:
    """A request to route: its chained block keys (opaque bytes) and prompt length in tokens.

    ``block_keys`` cover the prompt's blocks in order (full blocks; a trailing partial block may be
    included, as in the Mooncake trace). The conductor checks the count against ``prompt_len``.
    """

    request_id: str
    block_keys: tuple[bytes, ...]
    prompt_len: int

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if not isinstance(self.block_keys, tuple):
            object.__setattr__(self, "block_keys", tuple(self.block_keys))
        if set(map(type, self.block_keys)) <= {bytes} and b"" not in self.block_keys:
            return  # the common case, checked at C speed
        for i, key in enumerate(self.block_keys):
            if not isinstance(key, bytes) or not key:
                raise ValueError(f"block_keys[{i}] must be non-empty bytes, got {key!r}")


class Estimate(NamedTuple):
    """One way to run a request's prefill on one instance, and its predicted times (seconds).

    ``prefix_blocks`` blocks are reused, of which ``pull_blocks`` are first pulled from the
    best holder. ``ttft = t_transfer + t_queue + t_prefill``. This and the two candidate records
    are named tuples (immutable, built once per instance per decision: cheaper than dataclasses).
    """

    prefix_blocks: int
    pull_blocks: int
    t_transfer: float
    t_queue: float
    t_prefill: float

    @property
    def ttft(self) -> float:
        return self.t_transfer + self.t_queue + self.t_prefill


class PrefillCandidate(NamedTuple):
    """What the conductor predicts for one healthy prefill instance.

    ``local`` reuses only the instance's own prefix; ``balanced`` is Algorithm 1's option (pull
    the best match from its holder when the balancing rule says so, else the same as ``local``).
    """

    instance_id: str
    local_prefix_blocks: int
    queued_requests: int
    local: Estimate
    balanced: Estimate


class DecodeCandidate(NamedTuple):
    """Predicted TBT of one healthy decode instance if the request joined its batch."""

    instance_id: str
    batch_size: int
    context_tokens: int
    tbt_s: float


@dataclass(frozen=True)
class PolicyChoice:
    """A policy's pick: the index into the candidates, and whether to take the balanced option."""

    index: int
    pull: bool = False


@dataclass(frozen=True)
class PullPlan:
    """Blocks ``[start_block, start_block + num_blocks)`` of the request to copy from
    ``from_instance`` to the chosen prefill instance before it prefills."""

    from_instance: str
    start_block: int
    num_blocks: int


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes and why (every prediction the choice was made on)."""

    request_id: str
    policy: str
    prefill_id: str
    decode_id: str
    prompt_len: int
    local_prefix_blocks: int
    reused_blocks: int
    reused_tokens: int
    pull: PullPlan | None
    ttft_s: float
    t_queue: float
    t_prefill: float
    t_transfer: float
    tbt_s: float
    # every healthy instance's predictions, in the caller's order (built on first access by the
    # conductor; compare equal to tuples of the same records)
    candidates: Sequence[PrefillCandidate]
    decode_candidates: Sequence[DecodeCandidate]


class RejectReason(enum.Enum):
    TTFT_SLO = "ttft_slo"
    TBT_SLO = "tbt_slo"
    NO_INSTANCE = "no_instance"


@dataclass(frozen=True)
class Rejection:
    """A request the cluster cannot serve within its SLOs (the paper's HTTP 429).

    Predictions are those of the instances the policy would have chosen; they are None when
    there was no healthy instance of that kind.
    """

    request_id: str
    reason: RejectReason
    ttft_s: float | None
    tbt_s: float | None
    t_queue: float | None
    t_prefill: float | None
    t_transfer: float | None
    prefill_id: str | None
    decode_id: str | None
    ttft_slo_s: float | None
    tbt_slo_s: float | None

    def message(self) -> str:
        """Human text giving the predictions against the SLOs, e.g. for gRPC status details."""
        parts = [f"request {self.request_id} rejected ({self.reason.value})"]
        if self.ttft_s is None:
            parts.append("no healthy prefill instance")
        else:
            parts.append(
                f"predicted TTFT {self.ttft_s:.3f}s on {self.prefill_id} (queue {self.t_queue:.3f}s"
                f" + prefill {self.t_prefill:.3f}s + transfer {self.t_transfer:.3f}s)"
                f" vs SLO {_slo(self.ttft_slo_s)}"
            )
        if self.tbt_s is None:
            parts.append("no healthy decode instance")
        else:
            parts.append(
                f"predicted TBT {self.tbt_s:.4f}s on {self.decode_id} vs SLO {_slo(self.tbt_slo_s)}"
            )
        return "; ".join(parts)


def _slo(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f}s"
