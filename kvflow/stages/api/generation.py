"""One generation request as every front states it (gRPC, OpenAI, SGLang): ``GenerateInput``
is validated into a ``GenerateState`` in one place (``build_state``), and ``Generation`` runs
it on the front's pipeline: text deltas with stop strings, logprobs, the request ended early at
a stop string or when the caller goes away, usage and serving metrics at the end.

The fronts only translate their wire format to ``GenerateInput`` and ``Chunk``/``Usage`` back.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvflow.kvdb import DEFAULT_TENANT
from kvflow.pipeline import (
    AdmissionQueue,
    Overloaded,
    Priority,
    RequestCancelled,
    RequestContext,
    RequestHandle,
    RequestTrace,
    Ticket,
)
from kvflow.stages.api.convert import status_for
from kvflow.stages.api.limits import check_prompt_bytes
from kvflow.stages.detokenize import IncrementalDetokenizer
from kvflow.stages.engine import SamplingParams, TokenLogprob
from kvflow.stages.errors import InvalidArgument, NoCapacity
from kvflow.stages.state import GenerateState

logger = logging.getLogger(__name__)

TRACE_TENANT = "tenant"
"""The request-level trace attribute that names the request's tenant."""

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID = 128


@dataclass(frozen=True)
class GenerateInput:
    """A generation request before validation.

    Fields:
        prompt_text / prompt_ids: exactly one is given (text is encoded with the model's
            tokenizer, BOS added where the tokenizer adds one unless add_special_tokens is
            False: a rendered chat template holds its special tokens as text).
        tenant: "" is "default" (the caller's identity decides it: see http_auth).
        max_tokens: None takes the server default; else 1 .. the server's limit.
        sampling: SamplingParams fields other than max_tokens, only those the caller gave;
            ``defaults`` (e.g. the model's generation_config) fill the others.
        stop: stop strings (at most MAX_STOP_STRINGS of 1..MAX_STOP_CHARS characters).
        include_stop: keep the stop string at the end of the text.
        skip_special_tokens: leave special tokens out of the text.
        logprob_start: with sampling["prompt_logprobs"], the first prompt position wanted;
            the cache is used only before it (those positions are not computed here).
        request_id: "" picks one; skip_tokens: resume after that many generated tokens.
    """

    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    add_special_tokens: bool = True
    tenant: str = ""
    max_tokens: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special_tokens: bool = True
    logprob_start: int = 0
    request_id: str = ""
    skip_tokens: int = 0


@dataclass(frozen=True)
class Chunk:
    """New output: token ids, their text (whole characters, stop strings cut) and logprobs."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class Usage:
    """What a finished request cost and where it ran (seconds, tokens)."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    ttft_s: float
    mean_tbt_s: float
    e2e_s: float
    prefill_instance: str
    decode_instance: str
    predicted_ttft_s: float
    pulled_tokens: int


def request_id_of(given: str) -> str:
    """``given``, or a fresh id when it is empty; see :func:`check_request_id`."""
    return check_request_id(given or uuid.uuid4().hex[:16])


def check_request_id(rid: str) -> str:
    """``rid`` when it is a request id: 1 to MAX_REQUEST_ID printable characters without '/'.
    InvalidArgument names the rule otherwise."""
    if not rid or len(rid) > MAX_REQUEST_ID or not rid.isprintable() or "/" in rid:
        raise InvalidArgument(
            f"request_id must be 1 to {MAX_REQUEST_ID} printable characters without '/'"
        )
    return rid


def _check_stop(stop: tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise InvalidArgument(f"a stop string must have 1 to {MAX_STOP_CHARS} characters")


def build_state(inp: GenerateInput, config: Any) -> GenerateState:
    """The pipeline state of ``inp``; InvalidArgument naming what is wrong. ``config`` has
    ``default_max_tokens``, ``max_tokens_limit`` and ``max_prompt_bytes``."""
    max_tokens = config.default_max_tokens if inp.max_tokens is None else inp.max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidArgument(f"max_tokens must be an integer, got {max_tokens!r}")
    if not 1 <= max_tokens <= config.max_tokens_limit:
        raise InvalidArgument(
            f"max_tokens {max_tokens} is out of range [1, {config.max_tokens_limit}]"
        )
    if inp.skip_tokens > max_tokens:
        raise InvalidArgument(f"skip_tokens {inp.skip_tokens} is more than max_tokens {max_tokens}")
    _check_stop(inp.stop)
    try:
        sampling = SamplingParams(max_tokens=max_tokens, **{**inp.defaults, **inp.sampling})
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(str(exc)) from exc
    if (inp.prompt_text is None) == (inp.prompt_ids is None):
        raise InvalidArgument("give a prompt or token ids (exactly one)")
    if inp.prompt_text is not None:
        check_prompt_bytes(inp.prompt_text, config.max_prompt_bytes)  # before any tokenizing
    state = GenerateState(
        tenant=inp.tenant,
        max_tokens=max_tokens,
        sampling=sampling,
        prompt_text=inp.prompt_text,
        prompt_ids=None if inp.prompt_ids is None else list(inp.prompt_ids),
        add_special_tokens=inp.add_special_tokens,
        submitted_at=time.monotonic(),
    )
    if sampling.prompt_logprobs is not None:
        if inp.logprob_start < 0:
            raise InvalidArgument(f"logprob_start must be >= 0, got {inp.logprob_start}")
        state.max_reuse_tokens = max(0, inp.logprob_start - 1)
    return state


def of_tenant(tenant: str | None) -> Callable[[RequestTrace], bool] | None:
    """A trace filter that keeps ``tenant``'s requests (None: no filter, every tenant)."""
    if tenant is None:
        return None
    return lambda trace: trace.attrs.get(TRACE_TENANT) == tenant


class Generation:
    """One request on ``frontend``'s pipeline, submitted at construction.

    Construction raises InvalidArgument (bad input) or RateLimited (the tenant is over a
    limit of ``frontend.tenant_limits``: checked after validation; the permit is given back
    when the request ends). Iterate ``chunks()`` once (or ``cancel`` it): it first waits in
    the frontend's admission queue (``frontend.admission``; QueueFull when it is full), then
    submits; a request that finds no room (no staging or KV pages) waits again at its place,
    also after its first tokens (the retry's repeats of them are not sent again). It raises
    the request's error (a FinalError, a StageError...) and ends the request if the caller
    stops iterating early (a client that went away: its place in the queue, and every page,
    pin and booking, are freed). After it: ``finish_reason`` ("stop" | "length"),
    ``usage()``, ``prompt_logprobs``.
    Not thread-safe: use on the event loop that runs the pipeline."""

    def __init__(
        self, frontend: Any, inp: GenerateInput, priority: Priority = Priority.INTERACTIVE
    ) -> None:
        self._frontend = frontend
        self._inp = inp
        self.state = build_state(inp, frontend.config)
        self.request_id = request_id_of(inp.request_id)
        self.state.booking.request_id = self.request_id
        self._detok = self._detokenizer()
        self._skip = inp.skip_tokens
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self.text = ""
        self.handle: RequestHandle | None = None
        self._attempt = 0
        self._closed = False
        self._cancelled: str | None = None
        self._tenant = inp.tenant or DEFAULT_TENANT
        self._permit = frontend.tenant_limits.admit(self._tenant)
        self._admission: AdmissionQueue | None = getattr(frontend, "admission", None)
        self._ticket: Ticket | None = None
        if self._admission is not None:
            self._ticket = self._admission.ticket(_tokens_of(inp, self.state), priority)

    def _detokenizer(self) -> IncrementalDetokenizer:
        inp = self._inp
        return IncrementalDetokenizer(
            self._frontend.tokenizer,
            stop=inp.stop,
            skip_special_tokens=inp.skip_special_tokens,
            include_stop=inp.include_stop,
        )

    def cancel(self, reason: str) -> None:
        """End the request: before it was admitted it never runs; after, it is cancelled."""
        self._cancelled = reason
        if self.handle is not None:
            self.handle.cancel(reason)
        else:
            self._finish(ok=False)

    async def _start(self) -> None:
        """Wait in the admission queue (when the frontend has one), then submit. A request
        that found no room (Overloaded at submission, NoCapacity, also after its first
        tokens) waits again at its place: see ``_no_room``."""
        while True:
            if self._cancelled is not None:
                raise RequestCancelled(self._cancelled, request_id=self.request_id)
            ctx = RequestContext(self.request_id, state=self.state)
            ctx.set_attr(TRACE_TENANT, self._tenant)  # request-level: ExportTrace filters on it
            if self._admission is not None and self._ticket is not None:
                ticket = self._ticket
                with ctx.span("queue", priority=ticket.priority.name.lower()) as span:
                    await self._admission.wait(ticket)
                    span.set_attrs(queued_ms=round(ticket.queued_s * 1000.0, 3))
                    span.set_attrs(retries=ticket.retries)
            try:
                handle = self._frontend.pipeline.try_submit(ctx)
            except Overloaded:
                if self._admission is None:
                    self._finish(ok=False)
                    raise
                self._no_room()
                continue
            except BaseException:
                self._finish(ok=False)
                raise
            self._attempt += 1
            attempt = self._attempt
            self.handle = handle
            handle.add_done_callback(functools.partial(self._ended, attempt, handle))
            return

    def _may_retry(self, error: BaseException | None) -> bool:
        """Whether ``error`` is a lack of room that waiting can fix, and the caller still
        waits. Also after tokens were sent, while other requests run (their end makes room;
        a request that outgrew the pages running alone never fits): the retry regenerates
        the tokens (sampling is seeded per request id) and sends only the ones after them
        (``_no_room``)."""
        return (
            isinstance(error, NoCapacity | Overloaded)
            and self._admission is not None
            and (self.num_tokens == 0 or self._admission.running() > 1)
            and not self._closed
            and self._cancelled is None
        )

    def _no_room(self) -> None:
        """Back to the queue with a fresh state (the last attempt's ended and freed its). The
        tokens the caller has are skipped when the retry produces them again."""
        assert self._admission is not None and self._ticket is not None
        self._admission.no_room(self._ticket)
        self.state = build_state(self._inp, self._frontend.config)
        self.state.booking.request_id = self.request_id
        self._detok = self._detokenizer()
        self._skip += self.num_tokens  # what it still had to skip, plus what was sent
        self.num_tokens = 0

    def _ended(self, attempt: int, handle: RequestHandle) -> None:
        """The pipeline ended an attempt: its place and the tenant's permit are given back,
        unless it is retried (``chunks`` decides) or a later attempt runs."""
        if attempt != self._attempt or self._may_retry(handle.error):
            return
        self._finish(ok=handle.error is None or self._detok.stopped is not None)

    def _finish(self, ok: bool) -> None:
        self._permit.release()
        if self._admission is not None and self._ticket is not None:
            self._admission.release(self._ticket, ok=ok)

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._detok.stopped

    @property
    def prompt_logprobs(self) -> tuple[int, list[TokenLogprob]]:
        """(first position, TokenLogprobs) of the prompt, once the prefill has run."""
        return self.state.prompt_logprobs_start, list(self.state.prompt_logprobs)

    async def chunks(self) -> AsyncIterator[Chunk]:
        metrics = self._frontend.serving_metrics
        try:
            async for chunk in self._run():
                yield chunk
        except BaseException as exc:
            self._closed = True
            if self.handle is not None:
                self.handle.cancel("client went away" if _is_cancel(exc) else "server error")
            if _is_cancel(exc):
                metrics.requests.labels(outcome="cancelled").inc()
            else:
                metrics.requests.labels(outcome=status_for(exc)[0].name.lower()).inc()
            raise
        finally:
            self._closed = True
            if self.handle is None or self.handle.done():
                self._finish(ok=self.handle is not None and self.handle.error is None)
        metrics.requests.labels(outcome="ok").inc()
        self._observe()

    async def _run(self) -> AsyncIterator[Chunk]:
        while True:
            await self._start()
            assert self.handle is not None
            handle, detok = self.handle, self._detok
            try:
                async for kind, payload in handle:
                    if kind == "tokens" and detok.stopped is None:
                        chunk = self._chunk(payload)
                        if chunk is not None:
                            yield chunk
                await handle.result()
            except RequestCancelled:
                if detok.stopped is None:  # not our own cancel at a stop string
                    raise
            except (NoCapacity, Overloaded) as exc:
                if not self._may_retry(exc):
                    raise
                logger.info(
                    "req=%s: no room (%s) after %d tokens; waiting again",
                    self.request_id,
                    exc,
                    self.num_tokens,
                )
                self._no_room()
                continue
            break
        tail = detok.flush()
        self.text += tail
        stopped = detok.stopped is not None
        self.finish_reason = "stop" if stopped else self.state.finish_reason or "length"
        if tail:
            yield Chunk([], tail, [])

    def _chunk(self, payload: list[int]) -> Chunk | None:
        detok, state = self._detok, self.state
        if self._skip:  # the caller has these (a resumed request): their text goes unsent
            cut = min(self._skip, len(payload))
            self._skip -= cut
            detok.add(payload[:cut])
            self.num_tokens = detok.num_tokens
            payload = payload[cut:]
        start = self.num_tokens
        text = detok.add(payload) if payload else ""
        n = detok.num_tokens - start  # a stop string may end it inside this payload
        ids, self.num_tokens = list(payload[:n]), detok.num_tokens
        lps = (
            state.output_logprobs[start : start + n] if state.sampling.logprobs is not None else []
        )
        if detok.stopped is not None and self.handle is not None:
            self.handle.cancel("stop string")
        self.text += text
        return Chunk(ids, text, lps) if ids or text else None

    def usage(self) -> Usage:
        s = self.state
        ttft = (s.first_token_at or s.submitted_at) - s.submitted_at
        times = s.token_times[: max(1, self.num_tokens)]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        d = s.decision
        return Usage(
            request_id=self.request_id,
            prompt_tokens=s.prompt_len,
            completion_tokens=self.num_tokens,
            cached_tokens=s.num_cached_tokens,
            cached_by_tier=dict(s.cached_by_tier),
            ttft_s=ttft,
            mean_tbt_s=sum(gaps) / len(gaps) if gaps else 0.0,
            e2e_s=(s.finished_at or time.monotonic()) - s.submitted_at,
            prefill_instance=d.prefill_id if d else "",
            decode_instance=d.decode_id if d else "",
            predicted_ttft_s=d.ttft_s if d else 0.0,
            pulled_tokens=s.pulled_tokens,
        )

    def _observe(self) -> None:
        m, u = self._frontend.serving_metrics, self.usage()
        m.ttft.observe(u.ttft_s)
        times = self.state.token_times[: max(1, self.num_tokens)]
        for a, b in itertools.pairwise(times):
            m.tbt.observe(b - a)
        m.prompt_tokens.inc(u.prompt_tokens)
        m.generated_tokens.inc(u.completion_tokens)
        for tier, tokens in u.cached_by_tier.items():
            m.cached_tokens.labels(tier=tier).inc(tokens)


def _tokens_of(inp: GenerateInput, state: GenerateState) -> int:
    """What a request counts against the queue's token bound: its prompt's tokens (a text
    prompt: its UTF-8 bytes / 4, a guess before tokenizing) plus max_tokens."""
    if inp.prompt_ids is not None:
        prompt = len(inp.prompt_ids)
    else:
        prompt = len((inp.prompt_text or "").encode()) // 4 + 1
    return prompt + state.max_tokens


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.CancelledError | GeneratorExit)
