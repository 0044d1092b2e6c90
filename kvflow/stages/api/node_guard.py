"""NodeGuard: the router's node calls with deadlines sized to the work, a circuit breaker per
node, and cancellation of every in-flight call to a node found hung or marked unhealthy.

Why: a dead node fails its calls at once (the connection is refused or reset) and the request
is routed again; a *paused* node (SIGSTOP, a stuck process, a lost network) keeps its
connections open and answers nothing, so without this a call waits for its whole deadline.
Here, while a node has calls in flight, a watchdog probes it (``Info``, every
``probe_interval_s``, answered within ``probe_timeout_s``); a probe that goes unanswered, a
call that times out, or ``cancel_node`` (the router's refresh marked it unhealthy) ends every
call in flight to it with ``NodeCallFailed``, which the stage turns into a retry elsewhere.
A paused node then costs a request about ``probe_interval_s + probe_timeout_s`` more than a
dead one; a loaded node, whose probes are answered slowly, gets a longer probe timeout, and a
node whose calls still deliver events is not hung (``NodeCallBudget``).
A Prefill call is watched on two nodes: the prefill node it goes to and the decode
node its KV streams into (``state.decode``); if the decode node hangs, the call ends with
``NodeCallFailed`` for the decode node, so the request is routed again around it (the
prefill node itself bounds that stream with its own deadline and breaker, and reports such a
failure as ABORTED, which ``node_client`` blames on the decode node too).

The breaker (``kvflow.replication.CircuitBreaker``) counts failed calls and probes; while it is
open a call fails at once (the router routes around the node meanwhile), after ``open_s`` one
call is let through as the half-open probe. Deadlines: ``NodeCallBudget``.

Runs on the router's event loop (not thread-safe; every method from that loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import grpc

from kvflow.replication import BreakerConfig, CircuitBreaker
from kvflow.stages.api import node_pb2
from kvflow.stages.api.node_client import NodeClient
from kvflow.stages.errors import NodeBusy, NodeCallFailed
from kvflow.stages.state import GenerateState

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class NodeCallBudget:
    """Deadlines of the router's node calls and the hang watchdog.

    request_s: a request's whole budget, from its submission (``state.submitted_at``; a
    request sent back to the admission queue starts a fresh one). A Prefill or Decode call's
    deadline is what is left of it, at least ``base_s``: a node that has queued more work
    than the conductor predicted is slow, not broken, and is waited on (sizing deadlines from
    the prediction failed most requests of a loaded cluster: the prediction knows neither the
    other routers' requests nor a loaded CPU). A *hung* node is found by the watchdog, not by
    the deadline. short_s: Reserve/Release.

    The watchdog probes each node with calls in flight (``Info``, every ``probe_interval_s``);
    a probe unanswered within its timeout, while none of the node's calls delivered an event
    meanwhile, ends every call to it (and opens its breaker). The timeout follows the node's
    recent answers: ``probe_slack`` times the slowest of its last ``probe_window`` probes, at
    least ``probe_timeout_s`` (a paused idle node costs about a second) and at most
    ``probe_timeout_max_s`` (a loaded node answers in seconds, and is not hung).
    breaker: the per-node circuit breaker (``failure_threshold`` consecutive failed calls
    open it)."""

    base_s: float = 5.0
    request_s: float = 600.0
    short_s: float = 5.0
    probe_interval_s: float = 0.25
    probe_timeout_s: float = 0.75
    probe_slack: float = 4.0
    probe_timeout_max_s: float = 10.0
    probe_window: int = 8
    breaker: BreakerConfig = field(default_factory=lambda: BreakerConfig(failure_threshold=3))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "breaker" and not (
                isinstance(value, int | float) and math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{f.name}: must be a positive number, got {value!r}")
        if self.probe_timeout_max_s < self.probe_timeout_s:
            raise ValueError(
                f"probe_timeout_max_s ({self.probe_timeout_max_s}) is less than "
                f"probe_timeout_s ({self.probe_timeout_s})"
            )

    def deadline(self, state: GenerateState) -> float:
        """When ``state``'s request runs out of time (time.monotonic())."""
        return state.submitted_at + self.request_s

    def call_s(self, state: GenerateState, now: float | None = None) -> float:
        """A Prefill or Decode call's deadline: the request's time left, at least base_s."""
        left = self.deadline(state) - (time.monotonic() if now is None else now)
        return max(self.base_s, left)

    def probe_s(self, answered: Iterable[float]) -> float:
        """A probe's timeout after answers that took ``answered`` seconds (the recent ones)."""
        slowest = max(answered, default=0.0)
        return min(self.probe_timeout_max_s, max(self.probe_timeout_s, self.probe_slack * slowest))


# Resolved when a node a call depends on is declared down: (that node, why).
_Down = asyncio.Future[tuple[Any, str]]


@dataclass
class _Peer:
    breaker: CircuitBreaker
    calls: set[_Down] = field(default_factory=set)
    watchdog: asyncio.Task[None] | None = None
    answered: deque[float] = field(default_factory=deque)  # recent probes' answer times (s)
    last_event: float = -math.inf  # when a call to it last delivered an event (monotonic)


class NodeGuard:
    """A ``remote_generate.NodeCalls`` over ``NodeClient`` (module doc). ``cancelled_calls``
    and ``probe_failures`` count for stats."""

    def __init__(self, budget: NodeCallBudget | None = None, client: NodeClient | None = None):
        self.budget = budget or NodeCallBudget()
        self._client = client or NodeClient()
        self._peers: dict[str, _Peer] = {}
        self.cancelled_calls = 0
        self.probe_failures = 0

    def breaker(self, node: Any) -> CircuitBreaker:
        peer = self._peers.get(node.instance_id)
        if peer is None:
            peer = self._peers[node.instance_id] = _Peer(CircuitBreaker(self.budget.breaker))
        return peer.breaker

    def cancel_node(self, node: Any, reason: str) -> int:
        """End every call in flight to ``node`` with NodeCallFailed(reason) and, if there was
        one, open its breaker. Returns how many calls it ended."""
        peer = self._peers.get(node.instance_id)
        if peer is None or not peer.calls:
            return 0
        peer.breaker.trip()
        ended = 0
        for down in list(peer.calls):
            if not down.done():
                down.set_result((node, reason))
                ended += 1
        if ended:
            self.cancelled_calls += ended
            logger.warning(
                "router: node=%s %s; ending its %d calls in flight", node.instance_id, reason, ended
            )
        return ended

    # -- NodeCalls ------------------------------------------------------------------------------
    def logprobs(self, msgs: Any) -> list[Any]:
        return self._client.logprobs(msgs)

    async def reserve(
        self, node: Any, request_id: str, num_pages: int, state: GenerateState
    ) -> Any:
        # held while the Prefill queues: as long as the request may wait
        hold = self.budget.call_s(state)
        call = self._client.reserve(node, request_id, num_pages, self.budget.short_s, hold)
        return await self._unary(node, call)

    async def release(self, node: Any, lease: Any) -> None:
        await self._unary(node, self._client.release(node, lease, timeout=self.budget.short_s))

    def prefill(
        self, node: Any, request_id: str, state: GenerateState, lease: Any
    ) -> AsyncIterator[Any]:
        timeout = self.budget.call_s(state)
        # its KV streams into the decode node: a hang there ends this call too
        target = state.decode
        also = (target,) if target is not None and target is not node else ()
        return self._stream(
            node, self._client.prefill(node, request_id, state, lease, timeout), also
        )

    def decode(
        self, node: Any, request_id: str, state: GenerateState, lease: Any, first: int
    ) -> AsyncIterator[Any]:
        timeout = self.budget.call_s(state)
        return self._stream(
            node, self._client.decode(node, request_id, state, lease, first, timeout)
        )

    # -- the guard ------------------------------------------------------------------------------
    def _enter(self, node: Any, also: tuple[Any, ...] = ()) -> _Down:
        """Admit a call to ``node`` (its breaker) and watch it on ``node`` and on ``also``
        (nodes the call depends on)."""
        breaker = self.breaker(node)
        if not breaker.allow():
            raise NodeCallFailed(node, f"node {node.instance_id}: circuit open (recent failures)")
        loop = asyncio.get_running_loop()
        down: _Down = loop.create_future()
        for watched in (node, *also):
            self.breaker(watched)
            peer = self._peers[watched.instance_id]
            peer.calls.add(down)
            if peer.watchdog is None or peer.watchdog.done():
                peer.watchdog = loop.create_task(self._watch(watched, peer))
        return down

    def _leave(self, down: _Down, nodes: tuple[Any, ...]) -> None:
        for node in nodes:
            self._peers[node.instance_id].calls.discard(down)
        if not down.done():
            down.cancel()

    def _outcome(self, node: Any, ok: bool) -> None:
        breaker = self.breaker(node)
        if ok:
            breaker.success()
        elif breaker.failure():
            self.cancel_node(node, "failed a call")

    async def _next(self, node: Any, step: Awaitable[T], down: _Down) -> T:
        """``step``, unless a node it depends on is declared down first (then
        NodeCallFailed for that node)."""
        task = asyncio.ensure_future(step)
        try:
            await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if not task.cancelled() and task.done():
            return task.result()
        failed, reason = down.result()
        raise NodeCallFailed(failed, f"node {failed.instance_id}: {reason} (call ended)")

    async def _unary(self, node: Any, call: Awaitable[T]) -> T:
        down = self._enter(node)
        try:
            result = await self._next(node, call, down)
        except NodeCallFailed as err:
            self._outcome(err.node, False)
            raise
        except NodeBusy:
            self._outcome(node, True)  # it answered: busy is not broken
            raise
        finally:
            self._leave(down, (node,))
        self._outcome(node, True)
        return result

    async def _stream(
        self, node: Any, stream: AsyncIterator[Any], also: tuple[Any, ...] = ()
    ) -> AsyncIterator[Any]:
        down = self._enter(node, also)
        it = stream.__aiter__()
        try:
            while True:
                try:
                    ev = await self._next(node, it.__anext__(), down)
                except StopAsyncIteration:
                    break
                except NodeCallFailed as err:
                    self._outcome(err.node, False)  # the node at fault: maybe one of ``also``
                    if err.node is not node:
                        self._outcome(node, True)  # it answered; end a half-open probe
                    raise
                except NodeBusy:
                    self._outcome(node, True)  # it answered: busy is not broken
                    raise
                self._peers[node.instance_id].last_event = time.monotonic()  # it works
                yield ev
            self._outcome(node, True)
        finally:
            self._leave(down, (node, *also))
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _watch(self, node: Any, peer: _Peer) -> None:
        """Probe ``node`` while it has calls in flight; end them if a probe goes unanswered
        and none of its calls delivered an event meanwhile (``NodeCallBudget``)."""
        b = self.budget
        while peer.calls:
            await asyncio.sleep(b.probe_interval_s)
            if not peer.calls:
                return
            timeout = b.probe_s(peer.answered)
            sent = time.monotonic()
            try:
                await node.stub.Info(node_pb2.InfoRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                if peer.last_event >= sent:  # slow to answer, but its calls make progress
                    self._answered(peer, timeout)
                    continue
                self.probe_failures += 1
                if peer.calls:
                    self.cancel_node(node, f"did not answer a probe within {timeout:.2f}s")
                return
            self._answered(peer, time.monotonic() - sent)

    def _answered(self, peer: _Peer, seconds: float) -> None:
        peer.answered.append(seconds)
        while len(peer.answered) > self.budget.probe_window:
            peer.answered.popleft()
