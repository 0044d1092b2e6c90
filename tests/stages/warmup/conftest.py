"""Warm-up tests: an embedded server with the warm-up service (WarmupBackgroundServer) and
helpers to submit a corpus and wait for the job over real gRPC."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvflow.stages.api.warmup import warmup_pb2, warmup_pb2_grpc
from kvflow.stages.serve.config import ServeConfig
from kvflow.stages.serve.warmup import WarmupBackgroundServer
from tests.e2e.conftest import base_config

BLOCK = 16






def config(model: Path, data_dir: Path, **overrides: Any) -> ServeConfig:
    return base_config(model, data_dir, **{"trace_capacity": 64, **overrides})


class Warm:
    """A running server and a Warmup stub."""

    def __init__(self, server: WarmupBackgroundServer) -> None:
        self.server = server
        self.stub = warmup_pb2_grpc.WarmupStub(server.channel)

    def submit(
        self,
        lines: list[Any] | None = None,
        *,
        files: list[tuple[str, bytes]] | None = None,
        **options: Any,
    ) -> Any:
        budget = options.pop("budget", {})
        dry_run = options.pop("dry_run", False)
        if files is None:
            body = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines or [])
            files = [("corpus.jsonl", body.encode())]
        req = warmup_pb2.SubmitRequest(
            files=[warmup_pb2.CorpusFile(name=n, content=c) for n, c in files],
            options=warmup_pb2.JobOptions(budget=warmup_pb2.Budget(**budget), **options),
            dry_run=dry_run,
        )
        return self.stub.Submit(req, timeout=60)

    def wait(self, job_id: str, timeout_s: float = 300.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.stub.Status(warmup_pb2.JobRequest(job_id=job_id), timeout=10)
            if status.state in ("done", "cancelled", "failed"):
                return status
            assert time.monotonic() < deadline, f"job {job_id} still {status.state}"
            time.sleep(0.05)

    def report(self, job_id: str) -> Any:
        return self.stub.Report(warmup_pb2.JobRequest(job_id=job_id), timeout=60)


@pytest.fixture
def make_warm(tmp_path: Path) -> Iterator[Any]:
    servers: list[WarmupBackgroundServer] = []

    def make(model: Path, data_dir: Path | None = None, **overrides: Any) -> Warm:
        d = data_dir or tmp_path / f"data{len(servers)}"
        server = WarmupBackgroundServer(config(model, d, **overrides))
        servers.append(server)
        return Warm(server)

    yield make
    for s in servers:
        s.close()


def is_rpc_error(exc: BaseException, code: grpc.StatusCode) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == code
