"""The conductor written per instance: the straightforward reference for the vectorised one.

:class:`ReferenceConductor` is the conductor as it was before vectorised scoring (commit
8ccae2c): one
:class:`InstanceSnapshot` per instance, one :class:`Estimate` pair and one
:class:`PrefillCandidate` per prefill instance, a Python ``min`` over them, and
:meth:`Policy.reference_choose`. Its decisions are the specification the fast
:class:`~kvflow.router.conductor.Conductor` must equal exactly (tests compare them on seeded
random states), and ``kvflow.tools.bench.simulator`` times it as the baseline. Same constructor
and ``route`` contract as the conductor; thread-safe in the same way.
"""

from __future__ import annotations

import random
import threading
import zlib
from collections.abc import Sequence

from kvflow.router.admission import check_slo, no_instance
from kvflow.router.config import RouterConfig
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
    RouteDecision,
    RouteRequest,
)


class ReferenceConductor:
    """See the module doc."""

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
        return self._policy.decides_pulls

    def route(
        self,
        req: RouteRequest,
        prefill: Sequence[InstanceState],
        decode: Sequence[InstanceState],
        now: float | None = None,
    ) -> RouteDecision | Rejection:
        """As :meth:`Conductor.route`."""
        max_blocks = -(-req.prompt_len // self.config.block_size)
        if len(req.block_keys) > max_blocks:
            raise ValueError(
                f"block_keys has {len(req.block_keys)} keys but prompt_len={req.prompt_len} "
                f"holds at most {max_blocks} blocks of {self.config.block_size}"
            )
        candidates = self._prefill_candidates(req, _healthy(prefill, InstanceKind.PREFILL, now))
        decode_candidates = []
        for snap in _healthy(decode, InstanceKind.DECODE, now):
            batch = snap.decode_batch_size + 1
            context = snap.decode_context_tokens + req.prompt_len
            tbt = self._decode_model.predict(batch, context)
            decode_candidates.append(DecodeCandidate(snap.instance_id, batch, context, tbt))
        if not candidates or not decode_candidates:
            best = min(candidates, key=lambda c: c.local.ttft) if candidates else None
            best_d = min(decode_candidates, key=lambda d: d.tbt_s) if decode_candidates else None
            return no_instance(
                self.config,
                req.request_id,
                (best.instance_id, best.local) if best else None,
                (best_d.instance_id, best_d.tbt_s) if best_d else None,
            )
        tie_break = zlib.crc32(req.request_id.encode())
        with self._policy_lock:
            choice = self._policy.reference_choose(candidates, tie_break)
        best_decode = decode_candidates[argmin([d.tbt_s for d in decode_candidates], tie_break)]
        chosen = candidates[choice.index]
        option = chosen.balanced if choice.pull else chosen.local
        rejection = check_slo(
            self.config, req.request_id, chosen.instance_id, option, best_decode.instance_id,
            best_decode.tbt_s,
        )  # fmt: skip
        if rejection is not None:
            return rejection
        pull = None
        if option.pull_blocks > 0:
            holder = next(c for c in candidates if c.local_prefix_blocks >= option.prefix_blocks)
            pull = PullPlan(holder.instance_id, chosen.local_prefix_blocks, option.pull_blocks)
        return RouteDecision(
            request_id=req.request_id,
            policy=self._policy.name,
            prefill_id=chosen.instance_id,
            decode_id=best_decode.instance_id,
            prompt_len=req.prompt_len,
            local_prefix_blocks=chosen.local_prefix_blocks,
            reused_blocks=option.prefix_blocks,
            reused_tokens=self._reused_tokens(req, option.prefix_blocks),
            pull=pull,
            ttft_s=option.ttft,
            t_queue=option.t_queue,
            t_prefill=option.t_prefill,
            t_transfer=option.t_transfer,
            tbt_s=best_decode.tbt_s,
            candidates=tuple(candidates),
            decode_candidates=tuple(decode_candidates),
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


def _healthy(
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
