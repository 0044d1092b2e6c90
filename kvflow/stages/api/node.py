"""The Node gRPC service (api/node.proto) of a NodeServer: Info, Prefill on a prefill node;
Reserve, Release and Decode on a decode node. Each call becomes a request on the node's
pipeline; errors map to gRPC status codes as in the inference API."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from kvflow.kvdb import Namespace, block_keys
from kvflow.pipeline import RequestContext
from kvflow.router import UnknownInstanceError
from kvflow.stages.api import node_pb2, node_pb2_grpc
from kvflow.stages.api.inference import sampling_from, status_for
from kvflow.stages.errors import InvalidArgument
from kvflow.stages.state import GenerateState
from kvflow.stages.stream import StreamTarget

if TYPE_CHECKING:
    from kvflow.stages.serve.node import NodeServer

STAGING_SEGMENT = "staging"


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


class NodeServicer(node_pb2_grpc.NodeServicer):  # type: ignore[misc,name-defined]
    def __init__(self, node: NodeServer) -> None:
        self._node = node

    async def Info(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._node
        e = n.engine
        return node_pb2.InfoReply(
            node_id=n.config.node_id,
            kind=n.config.kind,
            model_fingerprint=e.model_fingerprint,
            block_size=e.block_size,
            page_nbytes=e.page_nbytes,
            transfer_address=n.transfer_address,
            max_model_len=e.max_model_len,
            vocab_size=e.spec.vocab_size,
            active_requests=n.worker.num_active,
            free_pages=e.num_free_pages,
            free_staging=n.staging.num_free if n.config.kind == "decode" else 0,
            num_layers=n.layout.num_layers,
            num_kv_heads=n.layout.num_kv_heads,
            head_dim=n.layout.head_dim,
            dtype=n.layout.dtype,
            control_address=n.address,
            queued_prefill_s=n.state.queued_seconds(time.monotonic()),
            decode_batch_size=n.state.decode_batch_size,
            decode_context_tokens=n.state.decode_context_tokens,
        )

    def _namespace(self, tenant: str) -> Namespace:
        try:
            return Namespace(
                tenant or "default", self._node.engine.model_fingerprint, self._node.layout
            )
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._node
        if n.config.kind != "prefill":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a prefill node")
        queued = False
        try:
            ids = list(request.token_ids)
            ns = self._namespace(request.tenant)
            segment = await asyncio.to_thread(
                n.transfer.open_segment, request.target_transfer_address, request.target_segment
            )
            state = GenerateState(
                tenant=ns.tenant,
                max_tokens=1,
                sampling=sampling_from(request.sampling, 1),
                prompt_ids=ids,
                submitted_at=time.monotonic(),
            )
            state.namespace = ns
            state.block_keys = block_keys(ns, ids)
            state.prefill = n.instance  # type: ignore[assignment]
            state.stream_target = StreamTarget(
                segment, [int(o) for o in request.target_offsets], n.engine.page_nbytes
            )
            predicted = request.predicted_prefill_s
            n.state.enqueue(
                request.request_id, max(0.0, predicted) if math.isfinite(predicted) else 0.0
            )
            queued = True
            ctx = RequestContext(request.request_id, state=state)
            handle = n.pipeline.try_submit(ctx)
        except Exception as exc:
            if queued:  # not admitted: off the books again
                with contextlib.suppress(UnknownInstanceError):
                    n.state.finish(request.request_id)
            code, details = status_for(exc)
            await context.abort(code, details)
            return

        def first_token(payload: list[int]) -> Any:
            return node_pb2.PrefillEvent(first_token=payload[0], has_first_token=True)

        try:
            async for event in _relay(handle, context, first_token, "prefill"):
                yield event
        finally:  # the prefill stage releases it, but not when an earlier stage failed
            with contextlib.suppress(UnknownInstanceError):
                n.state.finish(request.request_id)
        yield node_pb2.PrefillEvent(
            done=True,
            finish_reason=state.finish_reason or "",
            cached_tokens=state.num_cached_tokens,
            cached_by_tier=state.cached_by_tier,
            pulled_tokens=state.pulled_tokens,
            streamed_bytes=state.streamed_bytes,
        )

    async def Reserve(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._node
        if n.config.kind != "decode":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode node")
        try:
            lease_id, lease = n.lease(request.request_id, int(request.num_pages))
        except Exception as exc:
            code, details = status_for(exc)
            await context.abort(code, details)
            return None
        return node_pb2.ReserveReply(
            lease_id=lease_id,
            transfer_address=n.transfer_address,
            segment=STAGING_SEGMENT,
            offsets=[n.staging.offset(s) for s in lease.slots],
        )

    async def Release(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._node
        lease = n.take_lease(request.lease_id) if n.config.kind == "decode" else None
        if lease is not None:
            n.staging.release(lease)
        return node_pb2.ReleaseReply(released=lease is not None)

    async def Decode(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._node
        if n.config.kind != "decode":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode node")
        lease = n.take_lease(request.lease_id)
        if lease is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"no staging lease {request.lease_id!r}"
            )
        ids = list(request.token_ids)
        try:
            ns = self._namespace(request.tenant)
            if len(ids) < 2 or request.num_prefix_tokens != len(ids) - 1:
                raise InvalidArgument("token_ids must be the prompt followed by the first token")
            state = GenerateState(
                tenant=ns.tenant,
                max_tokens=max(1, int(request.max_tokens)),
                sampling=sampling_from(request.sampling, max(1, int(request.max_tokens))),
                prompt_ids=ids[:-1],
                submitted_at=time.monotonic(),
            )
            state.namespace = ns
            state.decode = n.instance  # type: ignore[assignment]
            state.staging = lease
            state.first_token = ids[-1]
            state.first_token_at = time.monotonic()
            n.state.add_decode(request.request_id, len(ids))
            ctx = RequestContext(request.request_id, state=state)
            handle = n.pipeline.try_submit(ctx)
        except Exception as exc:
            n.staging.release(lease)
            code, details = status_for(exc)
            await context.abort(code, details)
            return
        try:
            async for event in _relay(
                handle, context, lambda payload: node_pb2.DecodeEvent(token_ids=payload), "decode"
            ):
                yield event
        finally:
            with contextlib.suppress(KeyError):
                n.state.remove_decode(request.request_id)
        yield node_pb2.DecodeEvent(finished=True, finish_reason=state.finish_reason or "")
