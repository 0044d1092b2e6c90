"""A real embedded cluster (tiny demo model) behind a real gRPC server on a free port, run on
its own event-loop thread (BackgroundServer); tests talk to it with ordinary gRPC stubs."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow.replication.wire import pb2 as meta_pb2
from kvflow.replication.wire import pb2_grpc as meta_pb2_grpc
from kvflow.security.grpc_auth import cluster_channel
from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient
from kvflow.stages.serve.background import BackgroundServer
from kvflow.stages.serve.config import ServeConfig
from kvflow.tools.supervise import LocalCluster

BLOCK = 16


class ServerThread(BackgroundServer):
    """A BackgroundServer with the helper the tests use most."""

    def generate(self, prompt: str | list[int], **kw: Any) -> tuple[list[int], Any, str]:  # type: ignore[override]
        """(token ids, usage, text) of one Generate call; max_tokens defaults to 8."""
        kw.setdefault("max_tokens", 8)
        msgs = super().generate(prompt, timeout=60, **kw)
        ids = [t for m in msgs for t in m.token_ids]
        return ids, msgs[-1].usage, "".join(m.text for m in msgs)


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
        assert inst.load_staging is not None
        assert inst.load_staging.num_free == server.config.staging_pages
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


@pytest.fixture(scope="session")
def one_of_each(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real cluster for the modules that only call into it (the attack suite, the cluster
    fuzz): 1 metadata replica, 1 prefill node, 1 decode node, 1 router on 127.0.0.1, with its
    secret; one request already served, so the prefill shard holds blocks. Tests must leave
    it serving."""
    cluster = LocalCluster(
        tmp_path_factory.mktemp("one-of-each"),
        meta=1,
        prefill=1,
        decode=1,
        model=tiny_model,
        extra=("--block-size", "16", "--num-pages", "128", "--dram-mb", "32"),
    )
    try:
        cluster.start(timeout_s=90)
        serve_one(cluster)
        yield cluster
    finally:
        cluster.stop()


def serve_one(cluster: Any) -> None:
    """One request of 65 tokens through the cluster's routers; it must produce a token."""
    with InferenceClient(cluster.addresses) as client:
        req = pb2.GenerateRequest(max_tokens=2)
        req.token_ids.ids.extend(range(5, 70))
        events = list(client.generate(req, timeout=60))
    assert sum(len(e.token_ids) for e in events) >= 1
    wait_recorded(cluster, "prefill-0")


def wait_recorded(cluster: Any, node: str, timeout_s: float = 60.0, blocks: int = 1) -> None:
    """Until the metadata lists at least ``blocks`` blocks on ``node``: a node reports what it
    stored in batches (heartbeat, replicator), later than the answer on a loaded machine."""
    request = meta_pb2.NodeBlocksRequest(node=node)
    deadline = time.monotonic() + timeout_s
    with cluster_channel(cluster.meta_addresses[0], cluster.secret) as channel:
        stub = meta_pb2_grpc.MetadataServiceStub(channel)
        while (n := stub.NodeBlocks(request, timeout=10).num_blocks) < blocks:
            assert time.monotonic() < deadline, (
                f"{n} of {blocks} blocks of {node} recorded in {timeout_s} s"
            )
            time.sleep(0.1)
