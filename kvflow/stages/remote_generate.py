"""remote-generate: the router's last stage. It runs reuse-load, prefill and stream on the
chosen prefill node and decode on the chosen decode node, through the node API; a node that
fails a call is routed around and the request is routed again (``route.route_and_commit``,
the same function the route stage uses). A node that refuses for lack of room (``NodeBusy``:
no staging or KV pages) is backpressure: the request is routed again among the other nodes of
that kind (the conductor's next-best), and when every one has refused it, ``NoCapacity`` sends
it back to wait in the admission queue (api/generation.py). Tokens already sent to the client
are never sent twice: a retry regenerates the same tokens (sampling is seeded per request id)
and only the new ones go out. A request whose calls failed ATTEMPTS times goes back to the
admission queue too (an overloaded cluster, not a broken request), with NoCapacity.

A request that has streamed tokens is not sent back to the queue at the first refusal: when
every node of a kind refused it, it waits here, backing off from BACKOFF_S to BACKOFF_MAX_S,
and is routed again among all nodes. Past its deadline (``deadline``:
``NodeCallBudget.deadline``) it ends with NoCapacity, and ``api.generation`` runs it again
from the queue, sending only the tokens after those the client has (never text twice).

The wire is not this module's business: ``NodeCalls`` (api/node_client.py) turns each call
into a proto request and each failure a retry can fix into ``NodeCallFailed``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from kvflow.pipeline import RequestContext, Stage
from kvflow.router import Conductor, InstanceState
from kvflow.stages.errors import NoCapacity, NodeBusy, NodeCallFailed
from kvflow.stages.route import route_and_commit
from kvflow.stages.state import GenerateState

logger = logging.getLogger(__name__)

ATTEMPTS = 5  # a request may meet several dead nodes before they are all marked
BACKOFF_S = 0.25  # the first wait of a started request that every node refused
BACKOFF_MAX_S = 4.0


class NodeRef(Protocol):
    """A node as the router books it."""

    instance_id: str
    state: InstanceState


class NodeCalls(Protocol):
    """The node API as the stage uses it. Each method raises NodeCallFailed(node) for a
    failure a retry elsewhere can fix; ``prefill``/``decode`` yield the node's events."""

    def logprobs(self, msgs: Any) -> list[Any]:
        """Engine TokenLogprobs of an event's TokenLogprob messages."""
        ...

    async def reserve(
        self, node: NodeRef, request_id: str, num_pages: int, state: GenerateState
    ) -> Any: ...

    async def release(self, node: NodeRef, lease: Any) -> None: ...

    def prefill(
        self, node: NodeRef, request_id: str, state: GenerateState, lease: Any
    ) -> AsyncIterator[Any]: ...

    def decode(
        self, node: NodeRef, request_id: str, state: GenerateState, lease: Any, first: int
    ) -> AsyncIterator[Any]: ...


class RemoteGenerateStage(Stage):
    """Fills ``first_token``, ``output_ids``, ``num_cached_tokens`` (as the prefill node
    reports it), ``finish_reason``; emits tokens. Retries up to ATTEMPTS times."""

    name = "generate"

    def __init__(
        self,
        calls: NodeCalls,
        conductor: Callable[[], Conductor],
        instances: Callable[[], tuple[Mapping[str, Any], Mapping[str, Any]]],
        block_size: Callable[[], int],
        instance_wait_s: float,
        on_failed: Callable[[Any], None],
        deadline: Callable[[GenerateState], float],
        on_wait: Callable[[], None] | None = None,
        on_busy: Callable[[Any], None] | None = None,
    ) -> None:
        self._calls = calls
        self._conductor = conductor
        self._instances = instances
        self._block_size = block_size
        self._instance_wait_s = instance_wait_s
        self._on_failed = on_failed
        self._on_wait = on_wait
        self._on_busy = on_busy
        self._deadline = deadline

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        busy: set[str] = set()  # nodes that refused this request for lack of room
        attempt = failures = 0
        backoff = BACKOFF_S
        while True:
            if attempt:
                await route_and_commit(
                    self._conductor(),
                    state,
                    ctx.request_id,
                    lambda: self._without(busy),
                    self._instance_wait_s,
                    self._on_wait,
                )
            attempt += 1
            try:
                await self._once(ctx, state)
                return
            except NodeBusy as err:
                busy.add(err.node.instance_id)  # type: ignore[attr-defined]
                if self._on_busy is not None:
                    self._on_busy(err.node)
                logger.info("req=%s: %s; trying another node", ctx.request_id, err)
                prefill, decode = self._without(busy)
                if not prefill or not decode:
                    if state.emitted_tokens == 0:  # back to the admission queue
                        raise NoCapacity(f"every node of a kind is busy ({err})") from err
                    await self._wait_started(ctx.request_id, state, backoff, err)
                    backoff = min(2 * backoff, BACKOFF_MAX_S)
                    busy.clear()
            except NodeCallFailed as err:
                self._on_failed(err.node)
                failures += 1
                logger.warning("req=%s attempt %d failed: %s", ctx.request_id, attempt, err)
                if failures == ATTEMPTS:  # wait in the admission queue and retry later
                    raise NoCapacity(
                        f"no node could take the request ({ATTEMPTS} failed calls; last: {err})"
                    ) from err

    async def _wait_started(
        self, request_id: str, state: GenerateState, seconds: float, err: NodeBusy
    ) -> None:
        """A started request that every node refused waits ``seconds`` (not past its
        deadline) to be routed again; NoCapacity once the deadline has passed."""
        left = self._deadline(state) - time.monotonic()
        if left <= 0:
            raise NoCapacity(
                f"every node of a kind stayed busy until the request's deadline ({err})"
            ) from err
        logger.info(
            "req=%s: every node of a kind is busy after %d tokens; retrying in %.2fs",
            request_id,
            state.emitted_tokens,
            min(seconds, left),
        )
        await asyncio.sleep(min(seconds, left))

    def _without(self, busy: set[str]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """The instances (prefill, decode) but those in ``busy``."""
        prefill, decode = self._instances()
        return (
            {k: v for k, v in prefill.items() if k not in busy},
            {k: v for k, v in decode.items() if k not in busy},
        )

    async def _once(self, ctx: RequestContext[Any], state: GenerateState) -> None:
        prefill, decode = state.prefill, state.decode
        assert prefill is not None and decode is not None
        pages = -(-state.prompt_len // self._block_size())
        with ctx.span("reserve", node=decode.instance_id):
            lease = await self._calls.reserve(decode, ctx.request_id, pages, state)
        produced: list[int] = []
        lps: list[Any] = []  # their logprobs (with sampling.logprobs)
        try:
            with ctx.span("prefill", node=prefill.instance_id) as span:
                done = None
                async for ev in self._calls.prefill(prefill, ctx.request_id, state, lease):
                    if ev.has_first_token:
                        produced.append(ev.first_token)
                        lps.extend(self._calls.logprobs(ev.first_token_logprob))
                        if state.first_token_at is None:
                            state.first_token_at = time.monotonic()
                        state.token_times = [state.first_token_at]
                        self._emit(ctx, state, produced, lps)
                    if ev.done:
                        done = ev
                if done is None or not produced:
                    raise NoCapacity(f"node {prefill.instance_id} ended the prefill early")
                state.num_cached_tokens = done.cached_tokens
                state.cached_by_tier = dict(done.cached_by_tier)
                state.pulled_tokens = done.pulled_tokens
                state.first_token = produced[0]
                state.prompt_logprobs = self._calls.logprobs(done.prompt_logprobs)
                state.prompt_logprobs_start = done.prompt_logprobs_start
                span.set_attrs(cached_tokens=done.cached_tokens)
            state.booking.release_prefill()  # the prefill queue booking is over
            if done.finish_reason == "stop" or state.max_tokens == 1:
                await self._calls.release(decode, lease)
                state.output_ids, state.finish_reason = produced, done.finish_reason or "length"
                state.token_times = [state.first_token_at or time.monotonic()]
                return
            with ctx.span("decode", node=decode.instance_id):
                async for ev in self._calls.decode(
                    decode, ctx.request_id, state, lease, produced[0]
                ):
                    if ev.token_ids:
                        produced.extend(ev.token_ids)
                        lps.extend(self._calls.logprobs(ev.logprobs))
                        state.token_times.extend(time.monotonic() for _ in ev.token_ids)
                        self._emit(ctx, state, produced, lps)
                    if ev.finished:
                        state.finish_reason = ev.finish_reason
            state.output_ids = produced
            state.finished_at = time.monotonic()
        except BaseException:
            with contextlib.suppress(NodeCallFailed):
                await self._calls.release(decode, lease)
            raise

    @staticmethod
    def _emit(
        ctx: RequestContext[Any], state: GenerateState, produced: list[int], lps: list[Any]
    ) -> None:
        """Emit the tokens past what the client already has (their logprobs first)."""
        if len(produced) > state.emitted_tokens:
            state.output_logprobs = lps
            ctx.emit(("tokens", produced[state.emitted_tokens :]))
            state.emitted_tokens = len(produced)

    async def cleanup(self, ctx: RequestContext[Any], error: BaseException | None) -> None:
        ctx.state.booking.release()
