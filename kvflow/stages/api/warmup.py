"""The gRPC warm-up job API (warmup.proto) over a ``WarmupManager``.

``job_tenant`` is the one place a job's tenant is decided: the caller's identity (its API
key's tenant; an admin may name another, api/auth.py), never the request field alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc

from kvflow.grpc_proto import load_proto
from kvflow.stages.api.auth import OPEN, Authenticator, PermissionDenied, tenant_for
from kvflow.stages.warmup import Budget, CorpusFile, JobOptions, WarmupManager
from kvflow.stages.warmup.manager import JobError, JobView, UnknownJob

warmup_pb2, warmup_pb2_grpc = load_proto("kvflow/stages/api/warmup.proto")
WARMUP_SERVICE_NAME: str = warmup_pb2.DESCRIPTOR.services_by_name["Warmup"].full_name

DEFAULT_TENANT = "default"


def job_tenant(
    request: Any, context: grpc.aio.ServicerContext | None, auth: Authenticator | None = None
) -> str:
    """The tenant a submitted job warms blocks for: the caller's key's (PermissionDenied
    when a user names another tenant); with no keys configured, the request's or default."""
    identity = OPEN
    if auth is not None and context is not None:
        identity = auth.identify_metadata(context.invocation_metadata())
    return tenant_for(identity, request.options.tenant) or DEFAULT_TENANT


def options_from(
    request: Any, context: grpc.aio.ServicerContext | None, auth: Authenticator | None = None
) -> JobOptions:
    """JobOptions of a SubmitRequest; ValueError names a bad field."""
    o = request.options
    b = o.budget
    fields: dict[str, Any] = {
        "tenant": job_tenant(request, context, auth),
        "budget": Budget(int(b.max_blocks), int(b.max_bytes), b.on_limit or "stop"),
        "replicas": int(o.replicas),
        "pin_ttl_s": float(o.pin_ttl_s),
        "format": o.format or "auto",
    }
    if o.segment_blocks:
        fields["segment_blocks"] = int(o.segment_blocks)
    return JobOptions(**fields)


def status_pb(view: JobView) -> Any:
    doc = dataclasses.asdict(view)
    doc["items_by_state"] = doc.pop("by_state")
    return warmup_pb2.JobStatus(**doc)


class WarmupServicer(warmup_pb2_grpc.WarmupServicer):  # type: ignore[misc,name-defined]
    def __init__(self, manager: WarmupManager, auth: Authenticator | None = None) -> None:
        self._manager = manager
        self._auth = auth

    async def Submit(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            options = options_from(request, context, self._auth)
            files = [CorpusFile(f.name, f.content) for f in request.files]
            view, est, errors = await self._manager.submit(files, options, request.dry_run)
        except PermissionDenied as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise AssertionError("unreachable") from exc
        except (JobError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from exc
        reply = warmup_pb2.SubmitReply(corpus_errors=[str(e) for e in errors])
        if view is not None:
            reply.job.CopyFrom(status_pb(view))
        if est is not None:
            doc = dataclasses.asdict(est)
            doc["item_errors"] = [f"item {i}: {m}" for i, m in est.item_errors]
            reply.estimate.CopyFrom(warmup_pb2.Estimate(**doc))
        return reply

    async def Status(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return status_pb(await self._call(context, self._view, request.job_id))

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return warmup_pb2.ListReply(jobs=[status_pb(v) for v in self._manager.list()])

    async def Cancel(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return status_pb(await self._call(context, self._manager.cancel, request.job_id))

    async def Report(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        rows, totals = await self._call(context, self._manager.report, request.job_id)
        return warmup_pb2.ReportReply(
            job_id=request.job_id,
            items=[warmup_pb2.ItemCoverage(**dataclasses.asdict(r)) for r in rows],
            totals=warmup_pb2.Totals(**dataclasses.asdict(totals)),
        )

    async def _view(self, job_id: str) -> JobView:
        return await self._manager.status(job_id)

    @staticmethod
    async def _call(context: grpc.aio.ServicerContext, fn: Any, job_id: str) -> Any:
        try:
            return await fn(job_id)
        except UnknownJob as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            raise AssertionError("unreachable") from exc


def add_warmup_service(
    server: grpc.aio.Server, manager: WarmupManager, auth: Authenticator | None = None
) -> None:
    """Mount the service on ``server`` (before it starts); ``auth`` decides job tenants."""
    warmup_pb2_grpc.add_WarmupServicer_to_server(WarmupServicer(manager, auth), server)
