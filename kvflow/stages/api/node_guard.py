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
dead one. A Prefill call is watched on two nodes: the prefill node it goes to and the decode
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
from collections.abc import AsyncIterator, Awaitable
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
    """Deadlines of the router's node calls, sized to the work, and the hang watchdog.

    base_s: added to every streaming call (connection, scheduling slack). prefill_factor:
    times the conductor's predicted queue + prefill seconds; prefill_s_per_token: the floor of
    that prediction per prompt token (a cold or wrong estimator). decode_s_per_token: per
    token of ``max_tokens`` plus the prompt's import. short_s: Reserve/Release.
    probe_interval_s / probe_timeout_s: the watchdog's Info probes while calls are in flight
    (one unanswered probe opens the breaker). breaker: the per-node circuit breaker
    (``failure_threshold`` consecutive failed calls open it)."""

    base_s: float = 5.0
    prefill_factor: float = 4.0
    prefill_s_per_token: float = 0.002
    decode_s_per_token: float = 0.25
    short_s: float = 5.0
    probe_interval_s: float = 0.25
    probe_timeout_s: float = 0.75
    breaker: BreakerConfig = field(default_factory=lambda: BreakerConfig(failure_threshold=3))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "breaker" and not (
                isinstance(value, int | float) and math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{f.name}: must be a positive number, got {value!r}")

    def prefill_s(self, state: GenerateState) -> float:
        decision = state.decision
        predicted = (decision.t_queue + decision.t_prefill) if decision is not None else 0.0
        floor = self.prefill_s_per_token * state.prompt_len
        return self.base_s + self.prefill_factor * max(predicted, floor)

    def decode_s(self, state: GenerateState) -> float:
        work = state.max_tokens + state.prompt_len * self.prefill_s_per_token
        return self.base_s + self.decode_s_per_token * work


# Resolved when a node a call depends on is declared down: (that node, why).
_Down = asyncio.Future[tuple[Any, str]]


@dataclass
class _Peer:
    breaker: CircuitBreaker
    calls: set[_Down] = field(default_factory=set)
    watchdog: asyncio.Task[None] | None = None


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

    async def reserve(self, node: Any, request_id: str, num_pages: int) -> Any:
        return await self._unary(
            node, self._client.reserve(node, request_id, num_pages, timeout=self.budget.short_s)
        )

    async def release(self, node: Any, lease: Any) -> None:
        await self._unary(node, self._client.release(node, lease, timeout=self.budget.short_s))

    def prefill(
        self, node: Any, request_id: str, state: GenerateState, lease: Any
    ) -> AsyncIterator[Any]:
        timeout = self.budget.prefill_s(state)
        # its KV streams into the decode node: a hang there ends this call too
        target = state.decode
        also = (target,) if target is not None and target is not node else ()
        return self._stream(
            node, self._client.prefill(node, request_id, state, lease, timeout), also
        )

    def decode(
        self, node: Any, request_id: str, state: GenerateState, lease: Any, first: int
    ) -> AsyncIterator[Any]:
        timeout = self.budget.decode_s(state)
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
                yield ev
            self._outcome(node, True)
        finally:
            self._leave(down, (node, *also))
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _watch(self, node: Any, peer: _Peer) -> None:
        """Probe ``node`` while it has calls in flight; end them if a probe goes unanswered."""
        b = self.budget
        while peer.calls:
            await asyncio.sleep(b.probe_interval_s)
            if not peer.calls:
                return
            try:
                await node.stub.Info(node_pb2.InfoRequest(), timeout=b.probe_timeout_s)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                self.probe_failures += 1
                if peer.calls:
                    self.cancel_node(node, f"did not answer a probe within {b.probe_timeout_s}s")
                return
