"""The Node gRPC service (api/node.proto): Info and ExportTrace on every node; Prefill on a
prefill node; Reserve, Release and Decode on a decode node. Each call becomes a request on the
node's pipeline; errors map to gRPC status codes as in the inference API (``convert``).

The servicer is typed against ``NodeCore``: what it needs of a node, nothing of how the node
is built (serve/node.py is one implementation)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from kvflow.kvdb import Namespace, block_keys
from kvflow.pipeline import Pipeline, RequestContext, Tracer, traces_to_dict
from kvflow.router import InstanceState
from kvflow.stages.api import node_pb2, node_pb2_grpc
from kvflow.stages.api.convert import (
    logprobs_to_msgs,
    pull_from_msg,
    sampling_from,
    status_for,
    trace_parent,
)
from kvflow.stages.api.generation import check_request_id
from kvflow.stages.errors import InvalidArgument
from kvflow.stages.hash import namespace_for
from kvflow.stages.runtime.flush import remove_unpinned
from kvflow.stages.runtime.pins import PinBook
from kvflow.stages.runtime.staging import STAGING_SEGMENT, LeaseBook
from kvflow.stages.state import GenerateState, StreamTarget
from kvflow.stages.stream import open_stream_target
from kvflow.transfer import LOCAL_PEER, TransferEngine


class NodeCore(Protocol):
    """What the Node service drives. ``kind`` is "prefill" or "decode"; ``leases`` is None
    on a prefill node; ``instance`` is the node's PrefillInstance or DecodeInstance;
    ``peer_breakers`` the breakers of its calls to other nodes (kvdb.PeerBreakers)."""

    node_id: str
    kind: str
    pipeline: Pipeline
    tracer: Tracer
    state: InstanceState
    instance: Any
    transfer: Any
    transfer_address: str
    model_fingerprint: str
    layout: Any
    page_nbytes: int
    leases: LeaseBook | None
    pins: PinBook | None
    peer_breakers: Any

    def info(self) -> dict[str, Any]:
        """The InfoReply fields: identity, model, layout, addresses and load."""
        ...


async def _relay(
    handle: Any, context: grpc.aio.ServicerContext, to_event: Any, what: str
) -> AsyncIterator[Any]:
    """The request's token payloads as events; on an error, cancel the request and abort the
    call with its status (a cancelled call propagates)."""
    try:
        async for kind, payload in handle:
            if kind == "tokens":
                yield to_event(payload)
        await handle.result()
    except BaseException as exc:
        handle.cancel(f"{what} failed or caller went away")
        if isinstance(exc, asyncio.CancelledError):
            raise
        code, details = status_for(exc)
        await context.abort(code, details)


def _open_target(transfer: TransferEngine, breakers: Any, address: str, segment: str) -> Any:
    """The staging segment a Prefill streams into: another node's transfer server
    (``host:port``), never this process's own memory. InvalidArgument names a missing or
    malformed target; an unreachable or hung one is StreamTargetFailed (``open_stream_target``:
    the decode node's breaker)."""
    if not address or not segment:
        raise InvalidArgument(
            "target_transfer_address and target_segment are required (a decode node's staging "
            "lease, from its Reserve reply)"
        )
    if ":" not in address or address == LOCAL_PEER or address.startswith("shm://"):
        raise InvalidArgument(
            f"target_transfer_address must be a node's host:port, got {address[:100]!r}"
        )
    try:
        return open_stream_target(transfer, breakers, address, segment)
    except ValueError as exc:  # a peer no transfer backend handles
        raise InvalidArgument(f"target_transfer_address: {exc}") from exc


def _context(request_id: str, state: GenerateState, context: grpc.aio.ServicerContext) -> Any:
    ctx = RequestContext(request_id, state=state)
    parent = trace_parent(context)
    if parent:
        ctx.set_attrs(trace_parent=parent)
    return ctx


class NodeServicer(node_pb2_grpc.NodeServicer):  # type: ignore[misc,name-defined]
    def __init__(self, node: NodeCore) -> None:
        self._node = node

    async def Info(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return node_pb2.InfoReply(**self._node.info())

    async def ExportTrace(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._node
        found = [t for rid in request.request_ids if (t := n.tracer.find(rid)) is not None]
        return node_pb2.NodeTraceReply(
            traces_json=json.dumps(traces_to_dict(found)).encode(),
            wall_offset_s=time.time() - time.monotonic(),
            node_id=n.node_id,
        )

    async def Pin(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        pins = self._node.pins
        if pins is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a prefill node")
            return None
        if not (math.isfinite(request.ttl_s) and request.ttl_s > 0):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ttl_s must be > 0")
            return None
        keys = [bytes(k) for k in request.keys]
        try:
            n = await asyncio.to_thread(pins.pin, keys, request.ttl_s, time.monotonic())
        except ValueError as exc:  # a malformed key
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return None
        return node_pb2.PinReply(pinned=n)

    async def FlushCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        result = await asyncio.to_thread(remove_unpinned, self._node.instance.store.shard)
        return node_pb2.FlushCacheReply(removed=result.removed, pinned=result.pinned)

    def _namespace(self, tenant: str) -> Namespace:
        return namespace_for(tenant, self._node.model_fingerprint, self._node.layout)

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._node
        if n.kind != "prefill":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a prefill node")
        state: GenerateState | None = None
        try:
            check_request_id(request.request_id)
            ids = list(request.token_ids)
            ns = self._namespace(request.tenant)
            pull = pull_from_msg(request)
            segment = await asyncio.to_thread(
                _open_target,
                n.transfer,
                n.peer_breakers,
                request.target_transfer_address,
                request.target_segment,
            )
            state = GenerateState(
                tenant=ns.tenant,
                max_tokens=1,
                sampling=sampling_from(request.sampling, 1),
                prompt_ids=ids,
                submitted_at=time.monotonic(),
            )
            state.booking.request_id = request.request_id
            state.namespace = ns
            state.block_keys = block_keys(ns, ids)
            state.prefill = n.instance
            state.pull, state.pulls_decided = pull, bool(request.pulls_decided)
            if request.HasField("max_reuse_tokens"):
                state.max_reuse_tokens = int(request.max_reuse_tokens)
            offsets = [int(o) for o in request.target_offsets]
            pages = -(-len(ids) // n.layout.block_size)
            if len(offsets) < pages:  # decided before the prefill runs, not after
                raise InvalidArgument(
                    f"target_offsets has {len(offsets)} slots; the prompt of {len(ids)} tokens "
                    f"needs {pages} pages"
                )
            state.stream_target = StreamTarget(segment, offsets, n.page_nbytes)
            predicted = request.predicted_prefill_s
            state.booking.book_prefill(
                n.state, max(0.0, predicted) if math.isfinite(predicted) else 0.0
            )
            handle = n.pipeline.try_submit(_context(request.request_id, state, context))
        except Exception as exc:
            if state is not None:  # not admitted: off the books again
                state.booking.release()
            code, details = status_for(exc)
            await context.abort(code, details)
            return

        def first_token(payload: list[int]) -> Any:
            return node_pb2.PrefillEvent(
                first_token=payload[0],
                has_first_token=True,
                first_token_logprob=logprobs_to_msgs(
                    node_pb2.TokenLogprob, state.output_logprobs[:1]
                ),
            )

        try:
            async for event in _relay(handle, context, first_token, "prefill"):
                yield event
        finally:  # the prefill stage releases it, but not when an earlier stage failed
            state.booking.release()
        yield node_pb2.PrefillEvent(
            done=True,
            finish_reason=state.finish_reason or "",
            cached_tokens=state.num_cached_tokens,
            cached_by_tier=state.cached_by_tier,
            pulled_tokens=state.pulled_tokens,
            streamed_bytes=state.streamed_bytes,
            prompt_logprobs=logprobs_to_msgs(node_pb2.TokenLogprob, state.prompt_logprobs),
            prompt_logprobs_start=state.prompt_logprobs_start,
        )

    def _leases(self) -> LeaseBook | None:
        return self._node.leases if self._node.kind == "decode" else None

    async def Reserve(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n, leases = self._node, self._leases()
        if leases is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode node")
            return None
        try:
            check_request_id(request.request_id)
            lease_id, lease = leases.lease(
                request.request_id, int(request.num_pages), float(request.hold_s)
            )
        except Exception as exc:
            code, details = status_for(exc)
            await context.abort(code, details)
            return None
        return node_pb2.ReserveReply(
            lease_id=lease_id,
            transfer_address=n.transfer_address,
            segment=STAGING_SEGMENT,
            offsets=[leases.staging.offset(s) for s in lease.slots],
        )

    async def Release(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        leases = self._leases()
        released = leases is not None and leases.release(request.lease_id)
        return node_pb2.ReleaseReply(released=released)

    async def Decode(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n, leases = self._node, self._leases()
        if leases is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode node")
            return
        lease = leases.take(request.lease_id)
        if lease is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"no staging lease {request.lease_id!r}"
            )
            return
        ids = list(request.token_ids)
        state: GenerateState | None = None
        try:
            check_request_id(request.request_id)
            ns = self._namespace(request.tenant)
            if len(ids) < 2 or request.num_prefix_tokens != len(ids) - 1:
                raise InvalidArgument("token_ids must be the prompt followed by the first token")
            max_tokens = max(1, int(request.max_tokens))
            state = GenerateState(
                tenant=ns.tenant,
                max_tokens=max_tokens,
                sampling=sampling_from(request.sampling, max_tokens),
                prompt_ids=ids[:-1],
                submitted_at=time.monotonic(),
            )
            state.booking.request_id = request.request_id
            state.namespace = ns
            state.decode = n.instance
            state.staging = lease
            state.first_token = ids[-1]
            state.first_token_at = time.monotonic()
            state.booking.book_decode(n.state, len(ids))
            handle = n.pipeline.try_submit(_context(request.request_id, state, context))
        except Exception as exc:
            if state is not None:
                state.booking.release()
            leases.staging.release(lease)
            code, details = status_for(exc)
            await context.abort(code, details)
            return
        sent = 0

        def tokens(payload: list[int]) -> Any:
            nonlocal sent
            assert state is not None
            lps = state.output_logprobs[sent : sent + len(payload)]
            sent += len(payload)
            return node_pb2.DecodeEvent(
                token_ids=payload, logprobs=logprobs_to_msgs(node_pb2.TokenLogprob, lps)
            )

        try:
            async for event in _relay(handle, context, tokens, "decode"):
                yield event
        finally:
            state.booking.release()
        yield node_pb2.DecodeEvent(finished=True, finish_reason=state.finish_reason or "")
