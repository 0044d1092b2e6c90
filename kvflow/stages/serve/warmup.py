"""Warm-up jobs in a serving process: the WarmTarget of the embedded server and of a cluster
router, and ``attach_warmup`` (the manager, its job store, its gRPC service).

Both submit segments to the process's own pipeline (the conductor routes them; the embedded
server's prefill instances or the router's prefill nodes compute them). They differ in how they
see the cache: the embedded server asks its prefill shards (``match_prefix``) and can pin
blocks; a router reads holders from the metadata group and cannot pin on nodes (no RPC yet).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvflow.kvdb import Namespace
from kvflow.pipeline import RequestContext
from kvflow.stages.api.inference import create_server
from kvflow.stages.api.warmup import add_warmup_service
from kvflow.stages.engine.model_card import ModelCard
from kvflow.stages.hash import namespace_for
from kvflow.stages.serve.background import BackgroundServer
from kvflow.stages.serve.embedded import EmbeddedCluster
from kvflow.stages.state import GenerateState
from kvflow.stages.warmup import WarmupManager
from kvflow.stages.warmup.materialize import Materializer
from kvflow.stages.warmup.store import FileJobStore


class FrontendTarget:
    """A WarmTarget over a Frontend (the embedded server or a router), after its start."""

    supports_pins = False

    def __init__(self, frontend: Any) -> None:
        self._f = frontend
        self.block_size = int(frontend.block_size)
        self.block_nbytes = int(frontend.conductor.config.block_nbytes)
        self.max_model_len = int(frontend.max_model_len)
        vocab = frontend.tokenizer.vocab_size
        self._vocab = min(vocab, getattr(frontend, "vocab_size", vocab))
        self._card = ModelCard.from_dir(frontend.model_dir)

    def namespace(self, tenant: str) -> Namespace:
        return namespace_for(tenant, self._f.model_fingerprint, self._f.layout)

    def materializer(self) -> Materializer:
        return Materializer(
            self._f.tokenizer, self._card.chat_template, self.block_size, self._vocab
        )

    def holders(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        rows = self._f.metadata.view().holders(list(keys))
        return [{str(n): _tier_name(t) for n, t in h.items()} for h in rows]

    def replica_target(self, key: bytes) -> int:
        return int(self._f.metadata.view().replica_target(key))

    def set_replica_target(self, keys: Sequence[bytes], n: int) -> None:
        for key in keys:
            self._f.metadata.set_replica_target(key, n, time.time())

    def pin(self, namespace: Namespace, keys: Sequence[bytes]) -> Any:
        raise NotImplementedError("pins are held by shards; a router has none")

    def unpin(self, token: Any) -> None:
        raise NotImplementedError("pins are held by shards; a router has none")

    def prefill_slots(self) -> int:
        return max(1, sum(1 for p in self._f.prefill.values() if p.state.healthy))

    def online_busy(self, warm_in_flight: int) -> bool:
        # This process's pipeline: another router's traffic reaches the conductor's books
        # through the nodes' load reports, which lag by a refresh, so it is not gated on.
        return bool(self._f.pipeline.in_flight() > warm_in_flight)

    def submit(self, request_id: str, state: GenerateState) -> Any:
        return self._f.pipeline.try_submit(RequestContext(request_id, state=state))

    def predict_prefill_s(self, prompt_len: int, reused_tokens: int) -> float:
        return float(self._f.conductor.predict_prefill_s(prompt_len, reused_tokens))

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        """Leading keys with a holder among the prefill nodes, from the metadata."""
        view = self._f.metadata.view()
        forget = getattr(view, "forget", None)
        if forget is not None:
            forget(list(keys))  # a fresh answer, not the view's cache
        prefill = set(self._f.prefill)
        n = 0
        for h in view.holders(list(keys)):
            if not any(str(node) in prefill for node in h):
                break
            n += 1
        return n


class EmbeddedTarget(FrontendTarget):
    """The embedded server: the shards in this process answer (no metadata lag) and pin."""

    supports_pins = True

    def holders(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        shards = [(sid, shard) for sid, (shard, _) in self._f.shards().items()]
        rows = []
        for key in keys:
            tiers = {sid: shard.tier_of(key) for sid, shard in shards}
            rows.append({sid: _tier_name(t) for sid, t in tiers.items() if t is not None})
        return rows

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        return max((p.match_prefix(list(keys)) for p in self._f.prefill.values()), default=0)

    def pin(self, namespace: Namespace, keys: Sequence[bytes]) -> Any:
        """Pin the leading ``keys`` each prefill shard holds; returns (client, keys) pairs."""
        taken = []
        for p in self._f.prefill.values():
            n = p.match_prefix(list(keys))
            if n:
                client = p.client(namespace)
                ok = client.pin(list(keys[:n]))
                taken.append(
                    (client, [k for k, pinned in zip(keys[:n], ok, strict=True) if pinned])
                )
        return taken

    def unpin(self, token: Any) -> None:
        for client, keys in token:
            if keys:
                client.unpin(keys)


def _tier_name(tier: Any) -> str:
    return str(getattr(tier, "name", tier)).lower()


def attach_warmup(
    server: grpc.aio.Server, frontend: Any, root: Path, *, embedded: bool, auth: Any = None
) -> WarmupManager:
    """Mount the warm-up service for ``frontend`` on ``server`` (before it starts); jobs are
    kept under ``root``. Call ``await manager.start()`` once the frontend serves, and
    ``await manager.stop()`` before stopping it."""
    target = EmbeddedTarget(frontend) if embedded else FrontendTarget(frontend)
    manager = WarmupManager(target, FileJobStore(root), frontend.metrics)
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
