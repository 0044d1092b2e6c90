"""Event-driven trace simulation: the conductor against a cost model instead of engines.

The model (one run is deterministic given the config, its seed and the records):

- Requests arrive at their trace timestamps (times ``time_scale``), in order; each is routed by a
  real :class:`Conductor` over the run's load arrays (:class:`SimLoads`, what a ``LoadTable``
  over :class:`InstanceState` objects would read) and a real :class:`LocalPrefixIndex` (one
  LRU per prefill instance, ``cache_capacity_blocks`` each).
- A routed request is booked on its prefill instance (``SimLoads.enqueue``) and handed to
  a :class:`PrefillInstance`, which batches and chunks prefills as the engine does. A request
  with a pull first moves its blocks over the holder's outbound link (one pull at a time per
  holder, so a hot holder congests); its chunks are scheduled once they arrived. Pulls are
  causal: the index only ever holds blocks whose prefill has completed.
- When its prefill completes, the request's blocks enter its instance's cache, its first token
  is out (TTFT = prefill end - arrival) and it goes to its decode instance
  (:class:`DecodeInstance`): it joins the continuous batch when its KV fits in memory, and its
  TBT follows the batch over time. The router sees a decode instance's actual batch
  (``add_decode`` at join, ``remove_decode`` at the end), not reservations. A request whose
  ``prompt + output`` tokens exceed a decode instance's whole memory is rejected on arrival
  (reason ``decode_memory``).
- KV streaming to decode overlaps prefill and is not charged.

Accounting is incremental (queue and batch sums written into the conductor's arrays where an
instance changes, a virtual token clock per decode batch, a reverse holder index), and the
conductor scores every prefill instance as arrays and every distinct decode load once (see the
router README), so a decision costs a few array operations over the instances plus Python work
per prefix holder, per running prefill and per distinct decode load. Per-request results are
kept in mutable records and frozen once at the end.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

from kvflow.router.conductor import Conductor
from kvflow.router.estimators import TransferEstimator
from kvflow.router.instances import InstanceKind, InstanceState, UnlockedInstanceState
from kvflow.router.local_index import LocalPrefixIndex
from kvflow.router.reference import ReferenceConductor
from kvflow.router.sim_config import SimulationConfig
from kvflow.router.sim_decode import DecodeInstance
from kvflow.router.sim_loads import SimLoads
from kvflow.router.sim_prefill import PrefillInstance, PrefillJob
from kvflow.router.sim_report import InstanceLoad, RequestOutcome, SimulationReport, summarise
from kvflow.router.trace import TraceRecord
from kvflow.router.types import Rejection, RouteDecision, RouteRequest

logger = logging.getLogger(__name__)
_new = object.__new__

PREFILL, DECODE = 0, 1
PROGRESS_EVERY = 500
GC_GEN0_THRESHOLD = 20_000
"""The young generation's collection threshold during a run (Python's default is 700)."""
DECODE_MEMORY = "decode_memory"
"""Rejection reason of a request whose KV exceeds a decode instance's whole memory."""


@dataclass(slots=True)
class _Request:
    """A request's outcome while the run is on (mutable; frozen by :meth:`outcome` at the end:
    three ``dataclasses.replace`` per request cost more than the routing decision)."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prefill_id: str | None = None
    decode_id: str | None = None
    reused_tokens: int = 0
    local_hit_tokens: int = 0
    pulled_blocks: int = 0
    predicted_ttft_s: float = 0.0
    ttft_s: float = 0.0
    prefill_done_s: float = 0.0
    decode_wait_s: float = 0.0
    tbt_s: float = 0.0
    finish_s: float = 0.0
    rejected: str | None = None
    keys: tuple[bytes, ...] = ()  # its block keys while its prefill runs

    def outcome(self) -> RequestOutcome:
        # the frozen dataclass's fields in one dict update (its __init__ sets them one
        # object.__setattr__ call each): the same instance, cheaper
        out = _new(RequestOutcome)
        out.__dict__.update(
            request_id=self.request_id, arrival_s=self.arrival_s, prompt_len=self.prompt_len,
            output_len=self.output_len, prefill_id=self.prefill_id, decode_id=self.decode_id,
            reused_tokens=self.reused_tokens, local_hit_tokens=self.local_hit_tokens,
            pulled_blocks=self.pulled_blocks, predicted_ttft_s=self.predicted_ttft_s,
            ttft_s=self.ttft_s, prefill_done_s=self.prefill_done_s,
            decode_wait_s=self.decode_wait_s, tbt_s=self.tbt_s, finish_s=self.finish_s,
            rejected=self.rejected,
        )  # fmt: skip
        return out


class _Cluster:
    """The simulated cluster's mutable state for one run (private to :func:`simulate`)."""

    def __init__(self, config: SimulationConfig, reference: bool = False) -> None:
        self.config = config
        prefill_ids = [f"prefill-{i}" for i in range(config.num_prefill)]
        decode_ids = [f"decode-{i}" for i in range(config.num_decode)]
        self.prefill_at = {instance_id: i for i, instance_id in enumerate(prefill_ids)}
        self.decode_at = {instance_id: i for i, instance_id in enumerate(decode_ids)}
        # the fast conductor reads the run's own load arrays (route_loads); the reference one
        # reads instance states, booked beside them (tuples: the same objects on every call;
        # unlocked: this run is single-threaded, servers keep the locked InstanceState)
        self.book = SimLoads(prefill_ids, decode_ids)
        self.states: tuple[tuple[InstanceState, ...], tuple[InstanceState, ...]] | None = None
        if reference:
            self.states = (
                tuple(UnlockedInstanceState(i, InstanceKind.PREFILL) for i in prefill_ids),
                tuple(UnlockedInstanceState(i, InstanceKind.DECODE) for i in decode_ids),
            )
        self.index = LocalPrefixIndex(config.cache_capacity_blocks)
        self.transfer = TransferEstimator(config.bandwidth_bytes_per_s, config.transfer_latency_s)
        router = ReferenceConductor if reference else Conductor
        self.conductor = router(
            config.router,
            self.index,
            config.predict_prefill_model or config.prefill_model,
            config.predict_decode_model or config.decode_model,
            self.transfer,
        )
        self.fast = self.conductor if isinstance(self.conductor, Conductor) else None
        self.engines = [
            PrefillInstance(
                instance_id,
                config.prefill_model,
                config.prefill_chunk_tokens,
                config.prefill_batch_tokens,
                partial(self.prefill_started, i),
                self.prefill_done,
            )
            for i, instance_id in enumerate(prefill_ids)
        ]
        self.batches = [
            DecodeInstance(instance_id, config.decode_model, config.decode_capacity_tokens)
            for instance_id in decode_ids
        ]
        self.link_busy_until = [0.0] * config.num_prefill
        self.events: list[tuple[float, int, int, int, int]] = []  # time, seq, kind, idx, version
        self.versions = [[0] * config.num_prefill, [0] * config.num_decode]
        self.seq = 0
        self.requests: dict[str, _Request] = {}

    # --- events -------------------------------------------------------------------------------
    def schedule(self, kind: int, idx: int, time: float | None) -> None:
        """(Re)schedule instance ``idx``'s next event; an older pending one becomes stale."""
        versions = self.versions[kind]
        version = versions[idx] = versions[idx] + 1
        if time is not None:
            self.seq = seq = self.seq + 1
            heapq.heappush(self.events, (time, seq, kind, idx, version))

    def drain(self, until: float | None) -> None:
        """Apply every event due at or before ``until`` (all of them when None)."""
        events = self.events
        versions = self.versions
        pop = heapq.heappop
        engines = self.engines
        while events and (until is None or events[0][0] <= until):
            time, _, kind, idx, version = pop(events)
            if version != versions[kind][idx]:
                continue
            if kind == PREFILL:  # self.schedule(PREFILL, idx, engines[idx].poke(time)), inline
                at = engines[idx].poke(time)
                prefill_versions = versions[PREFILL]
                version = prefill_versions[idx] = prefill_versions[idx] + 1
                if at is not None:
                    self.seq = seq = self.seq + 1
                    heapq.heappush(events, (at, seq, PREFILL, idx, version))
            else:
                self.decode_tick(idx, time)

    # --- prefill ------------------------------------------------------------------------------
    def submit(self, decision: RouteDecision, request: _Request, now: float) -> None:
        idx = self.prefill_at[decision.prefill_id]
        ready = now
        if decision.pull is not None:
            holder = self.prefill_at[decision.pull.from_instance]
            nbytes = decision.pull.num_blocks * self.config.router.block_nbytes
            wire = self.config.transfer_latency_s + nbytes / self.config.bandwidth_bytes_per_s
            busy = self.link_busy_until[holder]
            start = busy if busy > now else now  # max(now, busy), no call
            self.link_busy_until[holder] = ready = start + wire
            self.transfer.observe(nbytes, wire)
            self.index.insert(decision.pull.from_instance, request.keys[: decision.reused_blocks])
        predicted_s = decision.t_transfer + decision.t_prefill
        self.book.enqueue(idx, decision.request_id, predicted_s)
        if self.states is not None:
            self.states[0][idx].enqueue(decision.request_id, predicted_s)
        job = PrefillJob(decision.request_id, decision.prompt_len, decision.reused_tokens, ready)
        self.engines[idx].submit(job)
        self.schedule(PREFILL, idx, self.engines[idx].poke(now))

    def prefill_started(self, idx: int, request_id: str, now: float) -> None:
        self.book.start(idx, request_id, now)
        if self.states is not None:
            self.states[0][idx].start(request_id, now)

    def prefill_done(self, job: PrefillJob, at: float) -> None:
        request = self.requests[job.request_id]
        assert request.prefill_id is not None and request.decode_id is not None
        at_prefill = self.prefill_at[request.prefill_id]
        self.book.finish(at_prefill, job.request_id)
        if self.states is not None:
            self.states[0][at_prefill].finish(job.request_id)
        self.index.insert(request.prefill_id, request.keys)
        request.keys = ()
        request.ttft_s = at - request.arrival_s
        request.prefill_done_s = at
        idx = self.decode_at[request.decode_id]
        self.batches[idx].arrive(job.request_id, request.prompt_len, request.output_len, at)
        self.after_decode_change(idx)

    # --- decode -------------------------------------------------------------------------------
    def decode_tick(self, idx: int, time: float) -> None:
        book, states = self.book, self.states
        for request_id, joined_s, finished_s in self.batches[idx].advance(time):
            book.remove_decode(idx, request_id)
            if states is not None:
                states[1][idx].remove_decode(request_id)
            request = self.requests[request_id]
            request.finish_s = finished_s
            request.decode_wait_s = joined_s - request.prefill_done_s
            output_len = request.output_len
            request.tbt_s = (finished_s - request.prefill_done_s) / (
                output_len if output_len > 1 else 1
            )
        self.after_decode_change(idx)

    def after_decode_change(self, idx: int) -> None:
        batch = self.batches[idx]
        book, states = self.book, self.states
        for request_id, _ in batch.take_joined():
            prompt_len = self.requests[request_id].prompt_len
            book.add_decode(idx, request_id, prompt_len)
            if states is not None:
                states[1][idx].add_decode(request_id, prompt_len)
        self.schedule(DECODE, idx, batch.next_departure())

    # --- arrivals -----------------------------------------------------------------------------
    def arrive(self, request_id: str, record: TraceRecord, now: float) -> None:
        request = self.requests[request_id] = _Request(
            request_id, now, record.input_length, record.output_length
        )
        capacity = self.config.decode_capacity_tokens
        if capacity is not None and record.input_length + max(1, record.output_length) > capacity:
            # no decode instance could ever hold its KV: rejected up front (HTTP 429)
            request.rejected = DECODE_MEMORY
            return
        keys = record.block_keys
        if record.input_length >= 1:
            # trusted path: a trace record's keys are non-empty bytes (``hash_id_key``), the id
            # is non-empty, so RouteRequest's validation could not fail: skip it
            req = _new(RouteRequest)
            req.__dict__.update(
                request_id=request_id, block_keys=keys, prompt_len=record.input_length
            )
        else:
            req = RouteRequest(request_id, keys, record.input_length)  # raises the ValueError
        if self.fast is not None:
            book = self.book
            result = self.fast.route_loads(req, book.prefill(now), book.decode())
        else:
            assert self.states is not None
            result = self.conductor.route(req, *self.states, now=now)
        if isinstance(result, Rejection):
            request.rejected = result.reason.value
            return
        bs = self.config.router.block_size
        local_tokens = min(result.local_prefix_blocks * bs, record.input_length)
        request.prefill_id = result.prefill_id
        request.decode_id = result.decode_id
        request.reused_tokens = result.reused_tokens
        request.local_hit_tokens = min(local_tokens, result.reused_tokens)
        request.pulled_blocks = result.pull.num_blocks if result.pull else 0
        request.predicted_ttft_s = result.ttft_s
        request.keys = keys
        self.submit(result, request, now)

    def loads(self) -> list[InstanceLoad]:
        out = []
        for engine in self.engines:
            out.append(InstanceLoad(engine.instance_id, "prefill", engine.served, engine.busy_s, 0))
        for batch in self.batches:
            out.append(
                InstanceLoad(batch.instance_id, "decode", batch.served, batch.busy_s,
                             batch.peak_tokens)
            )  # fmt: skip
        return out


def simulate(
    config: SimulationConfig,
    records: Sequence[TraceRecord],
    progress: Callable[[int, int], None] | None = None,
    *,
    reference: bool = False,
) -> SimulationReport:
    """Replay ``records`` through a simulated cluster routed by ``config.router.policy``.

    Pure function of its arguments (fresh state per call; the conductor's ties and rng are
    seeded). Records are taken in timestamp order (stable for equal stamps). ``progress(done,
    total)`` is called every few hundred requests and at the end. ValueError when a request can
    never fit a decode instance's memory. ``reference=True`` routes with the per-instance
    :class:`ReferenceConductor` (same decisions, slower: a speed baseline and a cross-check).
    """
    with _fewer_collections():
        return _simulate(config, records, progress, reference)


def _simulate(
    config: SimulationConfig,
    records: Sequence[TraceRecord],
    progress: Callable[[int, int], None] | None,
    reference: bool,
) -> SimulationReport:
    cluster = _Cluster(config, reference)
    ordered = sorted(records, key=lambda r: r.timestamp_ms)
    t0 = ordered[0].timestamp_ms if ordered else 0
    events = cluster.events
    for i, record in enumerate(ordered):
        now = (record.timestamp_ms - t0) / 1000.0 * config.time_scale
        if events and events[0][0] <= now:  # the check drain() starts with, without a call
            cluster.drain(now)
        cluster.arrive(f"r{i}", record, now)
        if progress is not None and i % PROGRESS_EVERY == PROGRESS_EVERY - 1:
            progress(i + 1, len(ordered))
    cluster.drain(None)
    if progress is not None:
        progress(len(ordered), len(ordered))
    duration = (ordered[-1].timestamp_ms - t0) / 1000.0 * config.time_scale if ordered else 0.0
    report = summarise(
        config,
        cluster.conductor.policy_name,
        [request.outcome() for request in cluster.requests.values()],
        cluster.index.evicted_blocks,
        cluster.loads(),
        duration,
    )
    logger.info(
        "policy=%s requests=%d ttft_mean=%.3f hit=%.3f capacity=%.3f",
        report.policy, report.num_requests, report.ttft_mean_s, report.cache_hit_ratio,
        report.effective_capacity,
    )  # fmt: skip
    return report


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """A run allocates many small containers that live until its end (records, heap entries,
    index entries): the garbage collector would scan them again and again. During the run the
    objects alive before it (the trace records, their keys, modules) are frozen out of
    collections, unless the process froze objects itself, and the young generation is collected
    less often; both are restored after (process-wide settings: they change when collections
    happen, never what they collect)."""
    thresholds = gc.get_threshold()
    freeze = gc.isenabled() and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(max(thresholds[0], GC_GEN0_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()
