"""NodeClient: the router's side of the node API (stages/remote_generate.NodeCalls over gRPC).

Each call carries the trace context in its metadata (``convert.TRACE_PARENT``), so the node's
spans join the request's trace. A failure that a retry on another node can fix (UNAVAILABLE,
CANCELLED, INTERNAL) becomes ``NodeCallFailed(node)``; a refusal for lack of room
(RESOURCE_EXHAUSTED) or a call over its deadline (DEADLINE_EXCEEDED: the request's time ran
out on a node that answers, a slow one) becomes ``NodeBusy(node)``; ABORTED from a Prefill (its
KV stream's decode side failed: ``errors.StreamTargetFailed``) becomes ``NodeCallFailed(the
request's decode node)``; any other status propagates as it is. Every
call takes its deadline (``timeout``; the defaults are the ceilings); ``node_guard.NodeGuard``
sizes them to the work. A streaming call abandoned
before its end is cancelled on the wire."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvflow.stages.api import node_pb2
from kvflow.stages.api.convert import (
    TRACE_PARENT,
    logprobs_from_msgs,
    pull_to_fields,
    sampling_to_msg,
)
from kvflow.stages.engine import TokenLogprob
from kvflow.stages.errors import NodeBusy, NodeCallFailed
from kvflow.stages.state import GenerateState

RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
)
CALL_TIMEOUT_S = 600.0
SHORT_TIMEOUT_S = 10.0


def _trace(request_id: str, span: str) -> tuple[tuple[str, str], ...]:
    return ((TRACE_PARENT, f"{request_id}/{span}"),)


def _failed(node: Any, err: grpc.aio.AioRpcError, target: Any = None) -> BaseException:
    if err.code() == grpc.StatusCode.ABORTED and target is not None:
        return NodeCallFailed(
            target, f"node {target.instance_id} (via {node.instance_id}): {err.details()}"
        )
    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return NodeBusy(node, f"node {node.instance_id}: busy: {err.details()}")
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        # The request's time ran out on a node that answers (NodeGuard's probe finds a hung
        # one): a slow node, not a dead one; it stays routable.
        return NodeBusy(node, f"node {node.instance_id}: slow: {err.details()}")
    if err.code() in RETRYABLE:
        return NodeCallFailed(node, f"node {node.instance_id}: {err.code().name} {err.details()}")
    return err


class NodeClient:
    """Stateless: every node's stub is on the node object (``node.stub``)."""

    @staticmethod
    def logprobs(msgs: Any) -> list[TokenLogprob]:
        return logprobs_from_msgs(msgs)

    async def reserve(
        self,
        node: Any,
        request_id: str,
        num_pages: int,
        timeout: float = SHORT_TIMEOUT_S,
        hold_s: float = 0.0,
    ) -> Any:
        """Staging slots for the prompt's pages, held ``hold_s`` (0: the node's default)."""
        try:
            return await node.stub.Reserve(
                node_pb2.ReserveRequest(request_id=request_id, num_pages=num_pages, hold_s=hold_s),
                timeout=timeout,
                metadata=_trace(request_id, "reserve"),
            )
        except grpc.aio.AioRpcError as err:
            raise _failed(node, err) from err

    async def release(self, node: Any, lease: Any, timeout: float = SHORT_TIMEOUT_S) -> None:
        try:
            await node.stub.Release(
                node_pb2.ReleaseRequest(lease_id=lease.lease_id), timeout=timeout
            )
        except grpc.aio.AioRpcError as err:
            raise _failed(node, err) from err

    async def prefill(
        self,
        node: Any,
        request_id: str,
        state: GenerateState,
        lease: Any,
        timeout: float = CALL_TIMEOUT_S,
    ) -> AsyncIterator[Any]:
        decision = state.decision
        req = node_pb2.PrefillRequest(
            request_id=request_id,
            token_ids=state.prompt_ids,
            tenant=state.tenant,
            sampling=sampling_to_msg(state.sampling),
            target_transfer_address=lease.transfer_address,
            target_segment=lease.segment,
            target_offsets=lease.offsets,
            predicted_prefill_s=decision.t_prefill if decision else 0.0,
            **pull_to_fields(state.pull, state.pulls_decided),
        )
        if state.max_reuse_tokens is not None:
            req.max_reuse_tokens = state.max_reuse_tokens
        call = node.stub.Prefill(req, timeout=timeout, metadata=_trace(request_id, "prefill"))
        async for ev in self._events(node, call, target=state.decode):
            yield ev

    async def decode(
        self,
        node: Any,
        request_id: str,
        state: GenerateState,
        lease: Any,
        first: int,
        timeout: float = CALL_TIMEOUT_S,
    ) -> AsyncIterator[Any]:
        assert state.prompt_ids is not None
        req = node_pb2.DecodeRequest(
            request_id=request_id,
            lease_id=lease.lease_id,
            token_ids=[*state.prompt_ids, first],
            num_prefix_tokens=state.prompt_len,
            max_tokens=state.max_tokens,
            sampling=sampling_to_msg(state.sampling),
            tenant=state.tenant,
        )
        call = node.stub.Decode(req, timeout=timeout, metadata=_trace(request_id, "decode"))
        async for ev in self._events(node, call):
            yield ev

    @staticmethod
    async def _events(node: Any, call: Any, target: Any = None) -> AsyncIterator[Any]:
        """The call's events; ``target``: the node its stream writes into (a Prefill's
        decode node), blamed for ABORTED."""
        try:
            async for ev in call:
                yield ev
        except grpc.aio.AioRpcError as err:
            raise _failed(node, err, target) from err
        finally:
            if not call.done():
                call.cancel()
