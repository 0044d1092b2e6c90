"""Warm-up jobs in a serving process: ``attach_warmup`` (the manager, its job store, its
gRPC service).

Both submit segments to the process's own pipeline (the conductor routes them; the embedded
server's prefill instances or the router's prefill nodes compute them). They differ in how they
see the cache: the embedded server asks its prefill shards (``match_prefix``) and pins in
them; a router (serve/warmup_router.py) reads holders from the metadata group and asks the
nodes to pin (``Node.Pin``, with the TTL).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import grpc

from kvflow.stages.api.inference import create_server
from kvflow.stages.api.warmup import add_warmup_service
from kvflow.stages.serve.background import BackgroundServer
from kvflow.stages.serve.embedded import EmbeddedCluster
from kvflow.stages.serve.warmup_router import RouterTarget
from kvflow.stages.serve.warmup_targets import EmbeddedTarget, FrontendTarget
from kvflow.stages.warmup import WarmupManager
from kvflow.stages.warmup.replicated_store import MetadataJobStore
from kvflow.stages.warmup.store import FileJobStore, JobStore

__all__ = [
    "EmbeddedTarget",
    "FrontendTarget",
    "RouterTarget",
    "WarmupBackgroundServer",
    "attach_warmup",
]


def attach_warmup(
    server: grpc.aio.Server, frontend: Any, root: Path, *, embedded: bool, auth: Any = None
) -> WarmupManager:
    """Mount the warm-up service for ``frontend`` on ``server`` (before it starts). The
    embedded server keeps its jobs under ``root``; a router keeps them in the metadata group,
    as owner ``<host>/<root's name>`` (``warmup-router-<port>``: a restarted router takes its
    own jobs back at once). Call ``await manager.start()`` once the frontend serves, and
    ``await manager.stop()`` before stopping it."""
    if embedded:
        target: FrontendTarget = EmbeddedTarget(frontend)
        store: JobStore = FileJobStore(root)
    else:  # a router: the jobs live in the metadata group, so any router can resume them
        target = RouterTarget(frontend)
        store = MetadataJobStore(frontend.metadata, owner=f"{socket.gethostname()}/{root.name}")
    manager = WarmupManager(target, store, frontend.metrics)
    add_warmup_service(server, manager, auth)
    return manager


class WarmupBackgroundServer(BackgroundServer):
    """A BackgroundServer (tests, benchmarks) with the warm-up service mounted; its jobs live
    under ``config.data_dir / "warmup"``. ``manager`` is the WarmupManager."""

    async def _start(self, host: str, port: int) -> EmbeddedCluster:
        cluster = EmbeddedCluster(self.config)
        try:
            await cluster.start()
            self.server, self.port = create_server(cluster, host, port)
            self.manager = attach_warmup(
                self.server, cluster, self.config.data_dir / "warmup", embedded=True
            )
            await self.server.start()
            await self.manager.start()
        except BaseException:
            await cluster.stop()
            raise
        return cluster

    def close(self) -> None:
        manager = getattr(self, "manager", None)
        if manager is not None and self.loop.is_running():
            self.call(manager.stop, timeout=30.0)
        super().close()
