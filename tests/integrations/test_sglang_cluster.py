"""SGLang processes as kvflow cluster members: pages written by one process are read
bit-exact by another over TCP; a member killed mid-read gives misses, never errors or wrong
bytes; two models never see each other's pages."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvflow.replication import MetadataConfig, MetadataGroup
from kvflow.replication.service import create_meta_server
from kvflow.tools.bench.sglang_source import controller_class, prefetch_operation
from tests.conftest import pick_free_port
from tests.integrations.conftest import create_backend
from tests.integrations.sglang_pools import fill, indices, make_pool, page

ROOT = Path(__file__).resolve().parents[2]
PAGES = 12
SEED = 11


@pytest.fixture
def meta() -> Iterator[str]:
    """A one-replica metadata group with its gRPC service on 127.0.0.1."""
    group = MetadataGroup(MetadataConfig(self_address=f"127.0.0.1:{pick_free_port()}"))
    group.start()
    group.wait_ready(10)
    server, port = create_meta_server(group, "127.0.0.1", 0)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0).wait(5)
    group.close()


def _writer(
    meta: str, node_id: str, model: str, layout: str = "page_first"
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integrations.sglang_writer",
            meta,
            node_id,
            model,
            str(SEED),
            str(PAGES),
            layout,
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == f"READY {PAGES}", line
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _expected(layout: str = "page_first") -> list[torch.Tensor]:
    pool = make_pool("mha", layout, pages=PAGES)
    fill(pool, SEED)
    return [page(pool, p) for p in range(PAGES)]


def _reader(meta: str, model: str = "org/model-a", layout: str = "page_first"):
    pool = make_pool("mha", layout, pages=PAGES)
    backend = create_backend(
        pool, False, model=model, kvflow_meta=meta, kvflow_node_id="reader", kvflow_engine="memory"
    )
    return pool, backend


@pytest.mark.slow
@pytest.mark.cluster
def test_pages_written_by_one_process_are_read_bit_exact_by_another(meta: str) -> None:
    writer = _writer(meta, "writer", "org/model-a")
    pool, backend = _reader(meta)
    try:
        keys = [f"page-{i}" for i in range(PAGES)]
        assert backend.batch_exists(keys) == PAGES
        assert backend.batch_exists([*keys[:3], "absent", *keys[3:]]) == 3
        order = list(reversed(range(PAGES)))
        got = backend.batch_get_v1(keys, indices(order, pool.page_size))
        assert got == [True] * PAGES
        expected = _expected()
        for i, slot in enumerate(order):
            assert torch.equal(pool.get_data_page(slot * pool.page_size), expected[i])
        tiers = backend.get_stats().kvflow_tiers
        assert tiers["remote"] == 2 * PAGES and tiers["dram"] == 0  # read from the peer
        # another model in the same cluster: same page hashes, nothing visible
        other_pool, other = _reader_other(meta)
        try:
            assert other.batch_exists(keys) == 0
            assert other.batch_get_v1(keys[:2], indices([0, 1], pool.page_size)) == [False, False]
            assert torch.count_nonzero(other_pool.kv_buffer.float()) == 0
        finally:
            other.close()
    finally:
        backend.close()
        _stop(writer)


def _reader_other(meta: str):
    pool = make_pool("mha", "page_first", pages=PAGES)
    backend = create_backend(
        pool,
        False,
        model="org/model-b",
        kvflow_meta=meta,
        kvflow_node_id="reader-b",
        kvflow_engine="memory",
    )
    return pool, backend


@pytest.mark.slow
@pytest.mark.cluster
def test_member_killed_mid_read_gives_misses_never_errors_or_wrong_bytes(meta: str) -> None:
    writer = _writer(meta, "writer", "org/model-a")
    pool, backend = _reader(meta)
    expected = _expected()
    keys = [f"page-{i}" for i in range(PAGES)]
    results: list[list[bool]] = []
    errors: list[BaseException] = []
    wrong: list[int] = []
    stop = threading.Event()

    def read_loop() -> None:
        while not stop.is_set():
            try:
                pool.kv_buffer.zero_()
                got = backend.batch_get_v1(keys, indices(list(range(PAGES)), pool.page_size))
                results.append(got)
                for p, ok in enumerate(got):
                    if ok and not torch.equal(pool.get_data_page(p * pool.page_size), expected[p]):
                        wrong.append(p)
            except BaseException as exc:  # the test's point: nothing may raise
                errors.append(exc)
                return

    reader = threading.Thread(target=read_loop)
    try:
        reader.start()
        deadline = time.monotonic() + 20
        while len(results) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        writer.kill()  # SIGKILL while reads are in flight
        writer.wait(10)
        after = len(results)
        while len(results) < after + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        reader.join(30)
        backend.close()
        _stop(writer)
    assert errors == [] and wrong == []
    assert results[0] == [True] * PAGES
    assert results[-1] == [False] * PAGES  # the holder is gone: misses


@pytest.mark.slow
@pytest.mark.cluster
def test_zero_copy_writer_and_generic_reader_in_two_processes(meta: str) -> None:
    """MHA layer_first, where the two paths order a page's segments differently: a process
    backing up with batch_set_v1, another prefetching through SGLang's generic path."""
    writer = _writer(meta, "writer", "org/model-a", "layer_first")
    pool, backend = _reader(meta, layout="layer_first")
    try:
        keys = [f"page-{i}" for i in range(PAGES)]
        controller = SimpleNamespace(storage_host_pool=pool, storage_backend=backend)
        controller.page_size = pool.page_size
        order = list(reversed(range(PAGES)))
        hits = controller_class()._generic_page_get(
            controller, prefetch_operation(), keys, indices(order, pool.page_size)
        )
        assert hits == PAGES
        expected = _expected("layer_first")
        for i, slot in enumerate(order):
            assert torch.equal(page(pool, slot), expected[i]), i
        assert backend.get_stats().kvflow_tiers["remote"] == 2 * 3 * PAGES  # K, V per layer
    finally:
        backend.close()
        _stop(writer)
