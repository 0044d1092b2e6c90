"""GenerateState: what one Generate request carries from stage to stage, with the two objects
every stage shares: where its KV is streamed (StreamTarget) and what it has booked on its
instances (Booking).

Each stage fills its own group of fields; a field is None (or empty) until its stage ran.
Counters follow vLLM's habit: progress is counted in tokens (``num_cached_tokens``...).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.kvdb import BlockKey, Namespace
from kvflow.router import InstanceState, PullPlan, RouteDecision, UnknownInstanceError
from kvflow.stages.engine import SamplingParams

if TYPE_CHECKING:
    from kvflow.stages.runtime.instances import DecodeInstance, PrefillInstance
    from kvflow.stages.runtime.shared_loads import LoadShare
    from kvflow.stages.runtime.staging import StagingLease


@dataclass(frozen=True)
class StreamTarget:
    """Where a request's KV pages go: a transfer segment (the decode side's staging area, in
    this process or on a decode node) and the byte offset of each page's slot in it."""

    segment: Any  # transfer.SegmentHandle
    offsets: list[int]
    page_nbytes: int


class Booking:
    """What one request holds on its instances' books (router.InstanceState): predicted
    seconds in a prefill instance's queue, a slot in a decode instance's batch.

    The one owner of both: stages and servicers book through it and release through it.
    ``release_prefill``/``release_decode``/``release`` are idempotent and thread-safe, so
    every way a request can end (done, failed, cancelled, re-routed) may call them."""

    def __init__(self, request_id: str = "") -> None:
        self.request_id = request_id
        self._prefill: InstanceState | None = None
        self._decode: InstanceState | None = None
        self._lock = threading.Lock()

    def book_prefill(self, state: InstanceState, predicted_s: float) -> None:
        """Queue ``predicted_s`` on ``state``; ValueError on a bad time or duplicate id."""
        state.enqueue(self.request_id, predicted_s)
        with self._lock:
            self._prefill = state

    def book_decode(self, state: InstanceState, context_tokens: int) -> None:
        """Reserve a decode slot of ``context_tokens``; ValueError on a duplicate id."""
        state.add_decode(self.request_id, context_tokens)
        with self._lock:
            self._decode = state

    def commit(
        self, decision: RouteDecision, prefill: InstanceState, decode: InstanceState
    ) -> None:
        """Book a conductor decision: its transfer + prefill time and its prompt's slot."""
        self.release()
        self.request_id = decision.request_id
        self.book_prefill(prefill, decision.t_transfer + decision.t_prefill)
        self.book_decode(decode, decision.prompt_len)

    @property
    def holds_prefill(self) -> bool:
        return self._prefill is not None

    def start_prefill(self, now: float) -> None:
        """The booked prefill started running (its queue time now counts down)."""
        if self._prefill is not None:
            with contextlib.suppress(UnknownInstanceError):
                self._prefill.start(self.request_id, now)

    def grow_decode(self, tokens: int) -> None:
        if self._decode is not None:
            with contextlib.suppress(UnknownInstanceError):
                self._decode.grow_decode(self.request_id, tokens)

    def release_prefill(self) -> None:
        with self._lock:
            state, self._prefill = self._prefill, None
        if state is not None:
            with contextlib.suppress(UnknownInstanceError):
                state.finish(self.request_id)

    def release_decode(self) -> None:
        with self._lock:
            state, self._decode = self._decode, None
        if state is not None:
            with contextlib.suppress(UnknownInstanceError):
                state.remove_decode(self.request_id)

    def release(self) -> None:
        self.release_prefill()
        self.release_decode()


@dataclass
class GenerateState:
    # -- the request as received ---------------------------------------------------------------
    tenant: str
    max_tokens: int
    sampling: SamplingParams
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    # False for a rendered chat template (it holds its special tokens as text): the prompt
    # text is encoded without the BOS a raw prompt gets.
    add_special_tokens: bool = True
    submitted_at: float = 0.0
    booking: Booking = field(default_factory=Booking)
    # Reuse at most this many prompt tokens from the cache: prompt logprobs from position p
    # need position p - 1 computed here (None: no limit).
    max_reuse_tokens: int | None = None

    # -- tokenize / hash --------------------------------------------------------------------------
    namespace: Namespace | None = None
    block_keys: list[BlockKey] = field(default_factory=list)

    # -- route ---------------------------------------------------------------------------------
    decision: RouteDecision | None = None
    prefill: PrefillInstance | None = None
    decode: DecodeInstance | None = None

    # The conductor's pull plan, and whether the conductor decides pulls (then nothing else
    # is pulled from prefill instances except as the fallback of a failed planned pull).
    pull: PullPlan | None = None
    pulls_decided: bool = False

    # -- reuse-load -----------------------------------------------------------------------------
    num_cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    pulled_tokens: int = 0
    prefix_pages: list[Any] = field(default_factory=list)
    pinned_keys: list[BlockKey] = field(default_factory=list)
    load_share: LoadShare | None = None  # the prefix's page buffers, maybe shared

    # -- prefill / stream -------------------------------------------------------------------------
    engine_request_id: str = ""
    prefill_admitted: bool = False
    prefill_done: bool = False
    block_queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    # set when the request's own end needs its prompt's stores (its decode is over, or it
    # failed): they stop waiting for other prompts' first tokens (runtime/store_gate.py)
    stores_due: asyncio.Event = field(default_factory=asyncio.Event)
    first_token: int | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    # With sampling.prompt_logprobs: TokenLogprobs of prompt positions prompt_logprobs_start...
    prompt_logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs_start: int = 0
    staging: StagingLease | None = None
    stream_target: StreamTarget | None = None
    streamed_blocks: int = 0
    streamed_bytes: int = 0
    stored_blocks: int = 0

    # -- decode -------------------------------------------------------------------------------
    decode_admitted: bool = False
    decode_request_id: str = ""
    # Colocated: the outputs of the decode that continues the prefill on the engine thread
    # (decode.py: DecodeStage.continuation); None while none was set up.
    decode_events: asyncio.Queue[Any] | None = None
    stored_decode_blocks: int = 0
    output_ids: list[int] = field(default_factory=list)
    # With sampling.logprobs: one TokenLogprob per generated token, appended before the
    # ("tokens", ids) event that carries the tokens is emitted.
    output_logprobs: list[Any] = field(default_factory=list)
    emitted_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None

    @property
    def prompt_len(self) -> int:
        return 0 if self.prompt_ids is None else len(self.prompt_ids)

    @property
    def colocated(self) -> bool:
        """Whether the request's prefill and decode instances share one engine (a colocated
        embedded server): then the decode adopts the prefill's pages in place, and nothing is
        staged or streamed. The one place that decides it."""
        return (
            self.prefill is not None
            and self.decode is not None
            and self.prefill.worker is self.decode.worker
        )

    def release_staging(self) -> None:
        """Give the decode staging slots back (idempotent): once the decode engine has
        imported them, or when the request ends without getting there."""
        if self.staging is not None and self.decode is not None:
            lease, self.staging = self.staging, None
            self.decode.staging.release(lease)
