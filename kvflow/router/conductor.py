"""The conductor: the paper's Algorithm 1 (KVCache-centric scheduling).

For one request the conductor

1. matches the request's block keys against every healthy prefill instance (``PrefixIndex``)
   and finds the best match anywhere (``best_len``, its first holder);
2. predicts, per instance, ``TTFT = T_transfer + T_queue + T_prefill`` twice: reusing only its
   local prefix, and the *balanced* option of Algorithm 1 lines 5-8 — when
   ``best_len > balancing_threshold * local_len`` it would pull the missing blocks from the
   holder. Following §4.2 ("if the estimated additional prefill time is shorter than the
   transfer time") the pull is only kept when ``T_transfer + T_prefill(pulled)`` beats
   ``T_prefill(local)``; otherwise the balanced option is the local one;
3. lets the configured policy pick the prefill instance (cache-aware = lowest balanced TTFT);
4. picks the decode instance with the lowest predicted TBT if the request joined its batch;
5. rejects when the TTFT or TBT SLO cannot be met (a :class:`Rejection` value), else returns a
   :class:`RouteDecision` with a :class:`PullPlan` when blocks must move.

``route`` does not mutate instance state or the index; the caller applies a decision with
:meth:`Conductor.commit` (or its own bookkeeping) and updates the index as blocks land.
"""

from __future__ import annotations

import logging
import random
import threading
import zlib
from collections.abc import Sequence

from kvflow.router.config import RouterConfig
from kvflow.router.errors import UnknownInstanceError
from kvflow.router.estimators import DecodeTimeModel, PrefillTimeModel, TransferEstimator
from kvflow.router.index import PrefixIndex
from kvflow.router.instances import InstanceKind, InstanceSnapshot, InstanceState
from kvflow.router.policies.base import argmin
from kvflow.router.policies.registry import make_policy
from kvflow.router.types import (
    DecodeCandidate,
    Estimate,
    PrefillCandidate,
    PullPlan,
    Rejection,
    RejectReason,
    RouteDecision,
    RouteRequest,
)

__all__ = [
    "Conductor",
    "PullPlan",
    "Rejection",
    "RouteDecision",
    "RouteRequest",
    "RouterConfig",
]

logger = logging.getLogger(__name__)


class Conductor:
    """Routes requests to (prefill, decode) instance pairs; see the module doc for the algorithm.

    Thread-safe: ``route`` serialises only the policy call (its rng / cursor) under a lock; the
    estimators and the index must be thread-safe themselves (the provided ones are).
    """

    def __init__(
        self,
        config: RouterConfig,
        prefix_index: PrefixIndex,
        prefill_model: PrefillTimeModel,
        decode_model: DecodeTimeModel,
        transfer_estimator: TransferEstimator,
    ) -> None:
        self.config = config
        self._index = prefix_index
        self._prefill_model = prefill_model
        self._decode_model = decode_model
        self._transfer = transfer_estimator
        self._policy = make_policy(config.policy, random.Random(config.seed))
        self._policy_lock = threading.Lock()
        self._match_all = getattr(prefix_index, "match_all", None)

    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def decides_pulls(self) -> bool:
        """Whether decisions' ``pull`` is the whole pull plan (see ``Policy.decides_pulls``)."""
        return self._policy.decides_pulls

    def route(
        self,
        req: RouteRequest,
        prefill: Sequence[InstanceState],
        decode: Sequence[InstanceState],
        now: float | None = None,
    ) -> RouteDecision | Rejection:
        """Choose instances for ``req``; ``now`` lets running work count only its remainder.

        Unhealthy instances are skipped. Raises ValueError when ``req.block_keys`` cannot belong
        to ``req.prompt_len`` tokens, or an instance is of the wrong kind.
        """
        self._check_request(req)
        prefill_snaps = _healthy_snapshots(prefill, InstanceKind.PREFILL, now)
        decode_snaps = _healthy_snapshots(decode, InstanceKind.DECODE, now)
        candidates = self._prefill_candidates(req, prefill_snaps)
        decode_candidates = self._decode_candidates(req, decode_snaps)
        if not candidates or not decode_candidates:
            return self._no_instance(req, candidates, decode_candidates)
        tie_break = zlib.crc32(req.request_id.encode())  # fair ties, still a pure decision
        with self._policy_lock:
            choice = self._policy.choose(candidates, tie_break)
        best_decode = decode_candidates[argmin([d.tbt_s for d in decode_candidates], tie_break)]
        chosen = candidates[choice.index]
        option = chosen.balanced if choice.pull else chosen.local
        rejection = self._check_slo(req, chosen.instance_id, option, best_decode)
        if rejection is not None:
            logger.info("req=%s %s", req.request_id, rejection.message())
            return rejection
        return self._decision(req, candidates, chosen, option, best_decode, decode_candidates)

    def predict_prefill_s(self, prompt_len: int, reused_tokens: int) -> float:
        """The prefill time model's prediction (seconds) for a prompt reusing a prefix."""
        return self._prefill_model.predict(prompt_len, min(reused_tokens, prompt_len))

    def commit(
        self, decision: RouteDecision, prefill_state: InstanceState, decode_state: InstanceState
    ) -> None:
        """Apply a decision to the chosen instances: enqueue its predicted transfer + prefill
        seconds on the prefill instance and reserve its prompt in the decode batch.

        Mutates both states. ValueError when the states are not the decision's instances.
        """
        if prefill_state.instance_id != decision.prefill_id:
            raise ValueError(
                f"prefill_state is {prefill_state.instance_id!r}, decision chose "
                f"{decision.prefill_id!r}"
            )
        if decode_state.instance_id != decision.decode_id:
            raise ValueError(
                f"decode_state is {decode_state.instance_id!r}, decision chose "
                f"{decision.decode_id!r}"
            )
        prefill_state.enqueue(decision.request_id, decision.t_transfer + decision.t_prefill)
        decode_state.add_decode(decision.request_id, decision.prompt_len)

    # --- steps of route -----------------------------------------------------------------------
    def _check_request(self, req: RouteRequest) -> None:
        max_blocks = -(-req.prompt_len // self.config.block_size)
        if len(req.block_keys) > max_blocks:
            raise ValueError(
                f"block_keys has {len(req.block_keys)} keys but prompt_len={req.prompt_len} "
                f"holds at most {max_blocks} blocks of {self.config.block_size}"
            )

    def _reused_tokens(self, req: RouteRequest, blocks: int) -> int:
        return min(blocks * self.config.block_size, req.prompt_len)

    def _local_lens(self, keys: Sequence[bytes], snaps: Sequence[InstanceSnapshot]) -> list[int]:
        if not keys:
            return [0] * len(snaps)
        ids = [s.instance_id for s in snaps]
        if self._match_all is not None:
            return list(self._match_all(ids, keys))
        return [self._index.match(i, keys) for i in ids]

    def _prefill_candidates(
        self, req: RouteRequest, snaps: Sequence[InstanceSnapshot]
    ) -> list[PrefillCandidate]:
        local_lens = self._local_lens(req.block_keys, snaps)
        best_len = max(local_lens, default=0)
        threshold = self.config.balancing_threshold
        t_prefill: dict[int, float] = {}  # reused blocks -> predicted prefill seconds
        t_pull: dict[int, float] = {}  # local blocks -> transfer seconds of the balanced pull
        out = []
        for snap, local_len in zip(snaps, local_lens, strict=True):
            t_local = t_prefill.get(local_len)
            if t_local is None:
                t_local = t_prefill[local_len] = self._predict_prefill(req, local_len)
            local = Estimate(local_len, 0, 0.0, snap.queued_seconds, t_local)
            balanced = local
            if best_len > threshold * local_len:
                t_best = t_prefill.get(best_len)
                if t_best is None:
                    t_best = t_prefill[best_len] = self._predict_prefill(req, best_len)
                t_transfer = t_pull.get(local_len)
                if t_transfer is None:
                    nbytes = (best_len - local_len) * self.config.block_nbytes
                    t_transfer = t_pull[local_len] = self._transfer.estimate(nbytes)
                if t_transfer + t_best < t_local:
                    balanced = Estimate(
                        best_len, best_len - local_len, t_transfer, snap.queued_seconds, t_best
                    )
            out.append(
                PrefillCandidate(snap.instance_id, local_len, snap.queued_requests, local, balanced)
            )
        return out

    def _predict_prefill(self, req: RouteRequest, blocks: int) -> float:
        return self._prefill_model.predict(req.prompt_len, self._reused_tokens(req, blocks))

    def _decode_candidates(
        self, req: RouteRequest, snaps: Sequence[InstanceSnapshot]
    ) -> list[DecodeCandidate]:
        out = []
        for snap in snaps:
            batch = snap.decode_batch_size + 1
            context = snap.decode_context_tokens + req.prompt_len
            tbt = self._decode_model.predict(batch, context)
            out.append(DecodeCandidate(snap.instance_id, batch, context, tbt))
        return out

    def _check_slo(
        self, req: RouteRequest, prefill_id: str, option: Estimate, decode: DecodeCandidate
    ) -> Rejection | None:
        cfg = self.config
        reason: RejectReason | None = None
        if cfg.ttft_slo_s is not None and option.ttft > cfg.ttft_slo_s:
            reason = RejectReason.TTFT_SLO
        elif cfg.tbt_slo_s is not None and decode.tbt_s > cfg.tbt_slo_s:
            reason = RejectReason.TBT_SLO
        if reason is None:
            return None
        return Rejection(
            req.request_id, reason, option.ttft, decode.tbt_s, option.t_queue, option.t_prefill,
            option.t_transfer, prefill_id, decode.instance_id, cfg.ttft_slo_s, cfg.tbt_slo_s,
        )  # fmt: skip

    def _no_instance(
        self,
        req: RouteRequest,
        candidates: Sequence[PrefillCandidate],
        decode_candidates: Sequence[DecodeCandidate],
    ) -> Rejection:
        best_prefill = min(candidates, key=lambda c: c.local.ttft) if candidates else None
        best_decode = min(decode_candidates, key=lambda d: d.tbt_s) if decode_candidates else None
        est = best_prefill.local if best_prefill else None
        rejection = Rejection(
            req.request_id,
            RejectReason.NO_INSTANCE,
            est.ttft if est else None,
            best_decode.tbt_s if best_decode else None,
            est.t_queue if est else None,
            est.t_prefill if est else None,
            est.t_transfer if est else None,
            best_prefill.instance_id if best_prefill else None,
            best_decode.instance_id if best_decode else None,
            self.config.ttft_slo_s,
            self.config.tbt_slo_s,
        )
        logger.warning("req=%s %s", req.request_id, rejection.message())
        return rejection

    def _decision(
        self,
        req: RouteRequest,
        candidates: Sequence[PrefillCandidate],
        chosen: PrefillCandidate,
        option: Estimate,
        decode: DecodeCandidate,
        decode_candidates: Sequence[DecodeCandidate],
    ) -> RouteDecision:
        pull = None
        if option.pull_blocks > 0:
            holder = next(
                c for c in candidates if c.local_prefix_blocks >= option.prefix_blocks
            )  # the first holder of the best match
            pull = PullPlan(holder.instance_id, chosen.local_prefix_blocks, option.pull_blocks)
        decision = RouteDecision(
            request_id=req.request_id,
            policy=self._policy.name,
            prefill_id=chosen.instance_id,
            decode_id=decode.instance_id,
            prompt_len=req.prompt_len,
            local_prefix_blocks=chosen.local_prefix_blocks,
            reused_blocks=option.prefix_blocks,
            reused_tokens=self._reused_tokens(req, option.prefix_blocks),
            pull=pull,
            ttft_s=option.ttft,
            t_queue=option.t_queue,
            t_prefill=option.t_prefill,
            t_transfer=option.t_transfer,
            tbt_s=decode.tbt_s,
            candidates=tuple(candidates),
            decode_candidates=tuple(decode_candidates),
        )
        logger.debug(
            "req=%s prefill=%s decode=%s reused=%d pull=%s ttft=%.4f tbt=%.4f",
            req.request_id, decision.prefill_id, decision.decode_id, decision.reused_blocks,
            pull, decision.ttft_s, decision.tbt_s,
        )  # fmt: skip
        return decision


def _healthy_snapshots(
    states: Sequence[InstanceState], kind: InstanceKind, now: float | None
) -> list[InstanceSnapshot]:
    out = []
    for state in states:
        if state.kind is not kind:
            raise ValueError(
                f"instance {state.instance_id!r} is {state.kind.value}, expected {kind.value}"
            )
        snap = state.snapshot(now)
        if snap.healthy:
            out.append(snap)
    return out


def find_state(states: Sequence[InstanceState], instance_id: str) -> InstanceState:
    """The state with ``instance_id``; UnknownInstanceError if absent."""
    for state in states:
        if state.instance_id == instance_id:
            return state
    raise UnknownInstanceError(f"no instance {instance_id!r}")
