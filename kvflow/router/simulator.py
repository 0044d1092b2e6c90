"""Event-driven trace simulation: the conductor against a cost model instead of engines.

The model (one run is deterministic given the config, its seed and the records):

- Requests arrive at their trace timestamps (times ``time_scale``), in order; each is routed by a
  real :class:`Conductor` over real :class:`InstanceState` objects, then committed.
- A prefill instance runs its requests one at a time, FIFO. A request with a pull first moves
  its blocks over the holder's outbound link (one pull at a time per holder, so a hot holder
  congests), then prefills for ``prefill_model.predict(prompt_len, reused_tokens)``.
- The chosen instance's prefix cache (a :class:`LocalPrefixIndex` LRU per instance) receives the
  request's blocks when it is routed, as the paper's conductor "updates the cache" at routing;
  FIFO order guarantees they are computed before any later request on it runs. The holder's
  pulled blocks are refreshed too.
- At prefill end the request joins its decode instance; its TBT is
  ``decode_model.predict(batch, context)`` at that moment (batch including reservations), held
  for its ``output_length`` tokens. KV streaming to decode overlaps prefill and is not charged.
- TTFT = prefill end - arrival.
"""

from __future__ import annotations

import enum
import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvflow.router.conductor import Conductor, find_state
from kvflow.router.estimators import TransferEstimator
from kvflow.router.index import LocalPrefixIndex
from kvflow.router.instances import InstanceKind, InstanceState
from kvflow.router.sim_config import SimulationConfig
from kvflow.router.sim_report import RequestOutcome, SimulationReport, summarise
from kvflow.router.trace import TraceRecord
from kvflow.router.types import Rejection, RouteDecision, RouteRequest

logger = logging.getLogger(__name__)


class _EventKind(enum.Enum):
    PREFILL_START = "prefill_start"
    PREFILL_DONE = "prefill_done"
    DECODE_DONE = "decode_done"


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    kind: _EventKind = field(compare=False)
    request_id: str = field(compare=False)
    instance_id: str = field(compare=False)
    tokens: int = field(compare=False, default=0)


class _Cluster:
    """The simulated cluster's mutable state for one run (private to :func:`simulate`)."""

    def __init__(self, config: SimulationConfig) -> None:
        self.config = config
        self.prefill = [
            InstanceState(f"prefill-{i}", InstanceKind.PREFILL) for i in range(config.num_prefill)
        ]
        self.decode = [
            InstanceState(f"decode-{i}", InstanceKind.DECODE) for i in range(config.num_decode)
        ]
        self.index = LocalPrefixIndex(config.cache_capacity_blocks)
        self.transfer = TransferEstimator(config.bandwidth_bytes_per_s, config.transfer_latency_s)
        self.conductor = Conductor(
            config.router,
            self.index,
            config.predict_prefill_model or config.prefill_model,
            config.predict_decode_model or config.decode_model,
            self.transfer,
        )
        self.busy_until = {s.instance_id: 0.0 for s in self.prefill}
        self.link_busy_until = {s.instance_id: 0.0 for s in self.prefill}
        self.events: list[_Event] = []
        self.seq = 0
        self.outcomes: dict[str, RequestOutcome] = {}

    def push(
        self, time: float, kind: _EventKind, request_id: str, instance_id: str, tokens: int = 0
    ) -> None:
        self.seq += 1
        heapq.heappush(self.events, _Event(time, self.seq, kind, request_id, instance_id, tokens))

    def drain(self, until: float | None) -> None:
        """Apply every event due at or before ``until`` (all of them when None)."""
        while self.events and (until is None or self.events[0].time <= until):
            event = heapq.heappop(self.events)
            self.apply(event)

    def apply(self, event: _Event) -> None:
        if event.kind is _EventKind.PREFILL_START:
            find_state(self.prefill, event.instance_id).start(event.request_id, event.time)
        elif event.kind is _EventKind.PREFILL_DONE:
            find_state(self.prefill, event.instance_id).finish(event.request_id)
            self.join_decode(event)
        else:  # DECODE_DONE
            find_state(self.decode, event.instance_id).remove_decode(event.request_id)

    def join_decode(self, event: _Event) -> None:
        outcome = self.outcomes[event.request_id]
        assert outcome.decode_id is not None
        state = find_state(self.decode, outcome.decode_id)
        tbt = self.config.decode_model.predict(state.decode_batch_size, state.decode_context_tokens)
        finish = event.time + outcome.output_len * tbt
        self.outcomes[event.request_id] = replace(outcome, tbt_s=tbt, finish_s=finish)
        self.push(finish, _EventKind.DECODE_DONE, event.request_id, outcome.decode_id)

    def run_prefill(self, decision: RouteDecision, keys: Sequence[bytes], now: float) -> float:
        """Schedule the decided prefill (and pull); returns the prefill end time."""
        pid = decision.prefill_id
        start = max(now, self.busy_until[pid])
        compute_start = start
        if decision.pull is not None:
            holder = decision.pull.from_instance
            nbytes = decision.pull.num_blocks * self.config.router.block_nbytes
            wire = self.config.transfer_latency_s + nbytes / self.config.bandwidth_bytes_per_s
            link_start = max(start, self.link_busy_until[holder])
            self.link_busy_until[holder] = link_start + wire
            compute_start = link_start + wire
            self.transfer.observe(nbytes, wire)
            self.index.insert(holder, keys[: decision.reused_blocks])
        duration = self.config.prefill_model.predict(decision.prompt_len, decision.reused_tokens)
        done = compute_start + duration
        self.busy_until[pid] = done
        self.push(start, _EventKind.PREFILL_START, decision.request_id, pid)
        self.push(done, _EventKind.PREFILL_DONE, decision.request_id, pid)
        self.index.insert(pid, keys)
        return done


def simulate(config: SimulationConfig, records: Sequence[TraceRecord]) -> SimulationReport:
    """Replay ``records`` through a simulated cluster routed by ``config.router.policy``.

    Pure function of its arguments (fresh state per call; the conductor's rng is seeded from
    ``config.router.seed``). Records are taken in timestamp order (stable for equal stamps).
    """
    cluster = _Cluster(config)
    ordered = sorted(records, key=lambda r: r.timestamp_ms)
    t0 = ordered[0].timestamp_ms if ordered else 0
    for i, record in enumerate(ordered):
        now = (record.timestamp_ms - t0) / 1000.0 * config.time_scale
        cluster.drain(now)
        req = RouteRequest(f"r{i}", record.block_keys, record.input_length)
        base = RequestOutcome(req.request_id, now, record.input_length, record.output_length)
        result = cluster.conductor.route(req, cluster.prefill, cluster.decode, now=now)
        if isinstance(result, Rejection):
            cluster.outcomes[req.request_id] = replace(base, rejected=result.reason.value)
            continue
        cluster.conductor.commit(
            result,
            find_state(cluster.prefill, result.prefill_id),
            find_state(cluster.decode, result.decode_id),
        )
        done = cluster.run_prefill(result, req.block_keys, now)
        cluster.outcomes[req.request_id] = replace(
            base,
            prefill_id=result.prefill_id,
            decode_id=result.decode_id,
            reused_tokens=result.reused_tokens,
            pulled_blocks=result.pull.num_blocks if result.pull else 0,
            predicted_ttft_s=result.ttft_s,
            ttft_s=done - now,
        )
    cluster.drain(None)
    report = summarise(
        cluster.conductor.policy_name, list(cluster.outcomes.values()), cluster.index.evicted_blocks
    )
    logger.info(
        "policy=%s requests=%d ttft_mean=%.3f hit=%.3f",
        report.policy, report.num_requests, report.ttft_mean_s, report.cache_hit_ratio,
    )  # fmt: skip
    return report
