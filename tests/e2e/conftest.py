"""A real embedded cluster (tiny demo model) behind a real gRPC server, on a free port,
run on its own event loop thread; tests talk to it with ordinary gRPC stubs."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvflow.stages.api import pb2, pb2_grpc
from kvflow.stages.cluster import EmbeddedCluster
from kvflow.stages.config import ServeConfig
from kvflow.stages.engine import write_demo_model
from kvflow.stages.service import create_server

BLOCK = 16


class ServerThread:
    """Runs cluster + server on a private loop. ``call(coro_fn)`` runs a coroutine there."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.cluster: EmbeddedCluster = self.call(self._start)
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb2_grpc.InferenceStub(self.channel)

    async def _start(self) -> EmbeddedCluster:
        cluster = EmbeddedCluster(self.config)
        await cluster.start()
        self.server, self.port = create_server(cluster, "127.0.0.1", 0)
        await self.server.start()
        return cluster

    def call(self, fn: Any, timeout: float = 60.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(fn(), self.loop)
        return fut.result(timeout)

    def generate(self, prompt: str | list[int], **kw: Any) -> tuple[list[int], Any, str]:
        """(token ids, usage, text) of one Generate call."""
        req = pb2.GenerateRequest(max_tokens=kw.pop("max_tokens", 8), **kw)
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.token_ids.ids.extend(prompt)
        msgs = list(self.stub.Generate(req, timeout=60))
        ids = [t for m in msgs for t in m.token_ids]
        return ids, msgs[-1].usage, "".join(m.text for m in msgs)

    def close(self) -> None:
        self.channel.close()

        async def stop() -> None:
            await self.server.stop(0.5)
            await self.cluster.stop()

        try:
            self.call(stop)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny"
    write_demo_model(path, preset="tiny", seed=0)
    return path


def base_config(model: Path, data_dir: Path, **overrides: Any) -> ServeConfig:
    config = ServeConfig(
        model_dir=model,
        data_dir=data_dir,
        block_size=BLOCK,
        num_pages=256,
        staging_pages=256,
        prefill_chunk=64,
        dram_capacity_bytes=64 << 20,
        ssd_capacity_bytes=256 << 20,
        default_max_tokens=8,
        max_tokens_limit=64,
        trace_capacity=256,
    )
    return dataclasses.replace(config, **overrides)


@pytest.fixture
def make_server(tiny_model: Path, tmp_path: Path) -> Iterator[Any]:
    servers: list[ServerThread] = []

    def make(**overrides: Any) -> ServerThread:
        data_dir = tmp_path / f"data{len(servers)}"
        server = ServerThread(base_config(tiny_model, data_dir, **overrides))
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """One prefill, one decode: shared by tests that only read."""
    s = ServerThread(base_config(tiny_model, tmp_path_factory.mktemp("data")))
    yield s
    s.close()


def assert_no_leaks(server: ServerThread) -> None:
    """Every engine page, staging slot, pin and queue entry is back."""
    cluster = server.cluster

    async def check() -> None:
        for _ in range(200):  # cleanup of a cancelled request finishes asynchronously
            if cluster.pipeline.in_flight() == 0:
                break
            await asyncio.sleep(0.01)

    server.call(check)
    assert cluster.pipeline.in_flight() == 0
    for inst in cluster.prefill.values():
        engine = inst.worker.engine
        assert inst.worker.call(lambda e: e.num_free_pages).result(10) == engine.num_pages
        assert inst.store.shard.num_pinned() == 0
        assert inst.state.queued_requests == 0
    for inst in cluster.decode.values():
        engine = inst.worker.engine
        assert inst.worker.call(lambda e: e.num_free_pages).result(10) == engine.num_pages
        assert inst.staging.num_free == server.config.staging_pages
        assert inst.state.decode_batch_size == 0


def long_prompt(n_words: int = 60, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    words = ["kv", "cache", "prefix", "block", "token", "store", "tier", "moon", "cake", "flow"]
    return " ".join(rng.choice(words) for _ in range(n_words))
