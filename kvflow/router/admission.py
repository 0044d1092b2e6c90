"""Admission: the SLO check and the no-instance rejection (Algorithm 1, step 5).

Pure functions of the router's configuration and the predictions of the instances a policy
chose; shared by the :class:`~kvflow.router.conductor.Conductor` and its per-instance reference
(:mod:`kvflow.router.reference`).
"""

from __future__ import annotations

from kvflow.router.config import RouterConfig
from kvflow.router.types import Estimate, Rejection, RejectReason


def check_slo(
    config: RouterConfig,
    request_id: str,
    prefill_id: str,
    option: Estimate,
    decode_id: str,
    tbt_s: float,
) -> Rejection | None:
    """A rejection when ``option`` misses the TTFT SLO (checked first) or ``tbt_s`` the TBT SLO;
    None when both are met (a value exactly at an SLO meets it) or not set."""
    reason: RejectReason | None = None
    if config.ttft_slo_s is not None and option.ttft > config.ttft_slo_s:
        reason = RejectReason.TTFT_SLO
    elif config.tbt_slo_s is not None and tbt_s > config.tbt_slo_s:
        reason = RejectReason.TBT_SLO
    if reason is None:
        return None
    return Rejection(
        request_id, reason, option.ttft, tbt_s, option.t_queue, option.t_prefill,
        option.t_transfer, prefill_id, decode_id, config.ttft_slo_s, config.tbt_slo_s,
    )  # fmt: skip


def no_instance(
    config: RouterConfig,
    request_id: str,
    prefill: tuple[str, Estimate] | None,
    decode: tuple[str, float] | None,
) -> Rejection:
    """The rejection when a kind has no healthy instance; ``prefill`` / ``decode`` are the best
    instance of the other kind (lowest local TTFT / TBT) with its prediction, when there is one."""
    est = prefill[1] if prefill else None
    return Rejection(
        request_id,
        RejectReason.NO_INSTANCE,
        est.ttft if est else None,
        decode[1] if decode else None,
        est.t_queue if est else None,
        est.t_prefill if est else None,
        est.t_transfer if est else None,
        prefill[0] if prefill else None,
        decode[0] if decode else None,
        config.ttft_slo_s,
        config.tbt_slo_s,
    )
