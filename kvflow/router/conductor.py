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

Speed: every instance is scored at once. Instance loads come from a :class:`LoadTable` per kind
(re-read only where an instance's version moved), predictions from :mod:`.scoring` (numpy, the
models run once per distinct prefix length), and the policy chooses over the arrays. Decisions
equal those of the per-instance :class:`~kvflow.router.reference.ReferenceConductor` exactly.
"""

from __future__ import annotations

import logging
import random
import threading
import zlib
from collections.abc import Sequence

from kvflow.router.admission import check_slo, no_instance
from kvflow.router.candidates import (
    DecodeTable,
    GroupedDecodeTable,
    LazyRecords,
    PrefillTable,
    argmin_array,
)
from kvflow.router.config import RouterConfig
from kvflow.router.errors import UnknownInstanceError
from kvflow.router.estimators import DecodeTimeModel, PrefillTimeModel, TransferEstimator
from kvflow.router.index import PrefixIndex
from kvflow.router.instances import InstanceKind, InstanceState
from kvflow.router.load_table import LoadArrays, LoadTable
from kvflow.router.policies.registry import make_policy
from kvflow.router.scoring import DecodeScorer, PrefillScorer
from kvflow.router.types import (
    Estimate,
    PullPlan,
    Rejection,
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
_new = object.__new__


class Conductor:
    """Routes requests to (prefill, decode) instance pairs; see the module doc for the algorithm.

    Thread-safe: ``route`` serialises the policy call (its rng / cursor) and each kind's load
    read under locks; the estimators and the index must be thread-safe themselves (the provided
    ones are).
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
        self._decode_scorer = DecodeScorer(decode_model)
        self._scorer = PrefillScorer(
            prefill_model,
            transfer_estimator,
            config.block_size,
            config.block_nbytes,
            config.balancing_threshold,
        )
        self._policy = make_policy(config.policy, random.Random(config.seed))
        self._policy_lock = threading.Lock()
        self._match_all = getattr(prefix_index, "match_all", None)
        self._match_holders = getattr(prefix_index, "match_holders", None)
        self._prefill_loads = LoadTable((), InstanceKind.PREFILL)
        self._decode_loads = LoadTable((), InstanceKind.DECODE)

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
        to ``req.prompt_len`` tokens, or an instance is of the wrong kind. Passing the same
        state objects in the same order on every call (as a server or the simulator does) lets
        the conductor re-read only the instances that changed.
        """
        self._check_request(req)
        prefill_load = self._prefill_table(prefill).read(now)
        decode_load = self._decode_table(decode).read(now)
        return self._route(req, prefill_load, decode_load)

    def route_loads(
        self, req: RouteRequest, prefill_load: LoadArrays, decode_load: LoadArrays
    ) -> RouteDecision | Rejection:
        """:meth:`route` over loads the caller keeps itself (the simulator's
        :class:`~kvflow.router.sim_loads.SimLoads`), already read at the decision's ``now``:
        the same decision as ``route`` over instance states with those loads. Does not mutate
        the arrays (the decision's lazy candidates read them later, so the caller must not
        either). Thread-safe as ``route`` is; ValueError as ``route`` raises it."""
        self._check_request(req)
        return self._route(req, prefill_load, decode_load)

    def _route(
        self, req: RouteRequest, prefill_load: LoadArrays, decode_load: LoadArrays
    ) -> RouteDecision | Rejection:
        held = self._held(req.block_keys, prefill_load)
        table = self._scorer.score(req, prefill_load, held)
        decode_table = self._decode_scorer.score(req, decode_load)
        if not len(table) or not len(decode_table):
            return self._no_instance(req, table, decode_table)
        tie_break = zlib.crc32(req.request_id.encode())  # fair ties, still a pure decision
        with self._policy_lock:
            choice = self._policy.choose(table, tie_break)
        best_decode, tbt_s = decode_table.best(tie_break)
        option = table.balanced(choice.index) if choice.pull else table.local(choice.index)
        config = self.config
        if config.ttft_slo_s is not None or config.tbt_slo_s is not None:  # else nothing to check
            rejection = check_slo(
                config,
                req.request_id,
                table.instance_ids[choice.index],
                option,
                decode_table.instance_ids[best_decode],
                tbt_s,
            )
            if rejection is not None:
                logger.info("req=%s %s", req.request_id, rejection.message())
                return rejection
        return self._decision(req, table, choice.index, option, decode_table, best_decode, tbt_s)

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

    def _prefill_table(self, states: Sequence[InstanceState]) -> LoadTable:
        table = self._prefill_loads
        if not table.serves(states):  # a new set of instances
            table = self._prefill_loads = LoadTable(states, InstanceKind.PREFILL)
        return table

    def _decode_table(self, states: Sequence[InstanceState]) -> LoadTable:
        table = self._decode_loads
        if not table.serves(states):
            table = self._decode_loads = LoadTable(states, InstanceKind.DECODE)
        return table

    def _held(self, keys: Sequence[bytes], load: LoadArrays) -> dict[int, int]:
        """Step 1: position -> local prefix blocks of every healthy instance holding any; the
        cheapest call the index offers (holders only, then all listed instances at once, then
        one by one)."""
        ids, positions = load.instance_ids, load.positions
        if not keys or not ids:
            return {}
        if self._match_holders is not None and positions is not None:
            held = {}
            for instance_id, length in self._match_holders(keys).items():
                at = positions.get(instance_id)
                if at is not None:
                    held[at] = length
            return held
        if self._match_all is not None:
            lens = self._match_all(ids, keys)
        else:
            lens = [self._index.match(i, keys) for i in ids]
        return {at: length for at, length in enumerate(lens) if length > 0}

    def _no_instance(
        self, req: RouteRequest, table: PrefillTable, decode_table: DecodeTable | GroupedDecodeTable
    ) -> Rejection:
        prefill = decode = None
        if len(table):
            best = argmin_array(table.local_ttft)
            prefill = (table.instance_ids[best], table.local(best))
        if len(decode_table):
            best, tbt_s = decode_table.best()
            decode = (decode_table.instance_ids[best], tbt_s)
        rejection = no_instance(self.config, req.request_id, prefill, decode)
        logger.warning("req=%s %s", req.request_id, rejection.message())
        return rejection

    def _decision(
        self,
        req: RouteRequest,
        table: PrefillTable,
        chosen: int,
        option: Estimate,
        decode_table: DecodeTable | GroupedDecodeTable,
        decode: int,
        tbt_s: float,
    ) -> RouteDecision:
        local_blocks = table.local_blocks(chosen)
        pull = None
        if option.pull_blocks > 0:  # from the first holder of the best match
            holder = table.first_holder(option.prefix_blocks)
            pull = _new(PullPlan)  # as the decision below, one dict update
            pull.__dict__.update(
                from_instance=table.instance_ids[holder],
                start_block=local_blocks,
                num_blocks=option.pull_blocks,
            )
        # RouteDecision's fields without its generated __init__ (one object.__setattr__ per
        # field of a frozen dataclass): the same instance, a third of the cost
        decision = _new(RouteDecision)
        decision.__dict__.update(
            request_id=req.request_id,
            policy=self._policy.name,
            prefill_id=table.instance_ids[chosen],
            decode_id=decode_table.instance_ids[decode],
            prompt_len=req.prompt_len,
            local_prefix_blocks=local_blocks,
            reused_blocks=option.prefix_blocks,
            reused_tokens=min(option.prefix_blocks * self.config.block_size, req.prompt_len),
            pull=pull,
            ttft_s=option.ttft,
            t_queue=option.t_queue,
            t_prefill=option.t_prefill,
            t_transfer=option.t_transfer,
            tbt_s=tbt_s,
            candidates=LazyRecords(table.records),
            decode_candidates=LazyRecords(decode_table.records),
        )
        if logger.isEnabledFor(logging.DEBUG):  # what debug() checks first, without its call
            logger.debug(
                "req=%s prefill=%s decode=%s reused=%d pull=%s ttft=%.4f tbt=%.4f",
                req.request_id, decision.prefill_id, decision.decode_id, decision.reused_blocks,
                pull, decision.ttft_s, decision.tbt_s,
            )  # fmt: skip
        return decision


def find_state(states: Sequence[InstanceState], instance_id: str) -> InstanceState:
    """The state with ``instance_id``; UnknownInstanceError if absent."""
    for state in states:
        if state.instance_id == instance_id:
            return state
    raise UnknownInstanceError(f"no instance {instance_id!r}")
