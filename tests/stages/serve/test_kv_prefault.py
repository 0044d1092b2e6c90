"""`--kv-prefault` (the default of `kvflow serve`): one memory-planned pool's KV pages of the
engine that prefills are written at start, so the prompts' steps take no first-use page
faults (issue 31: on a fresh server the long prompts' steps spent ~1 s of each engine thread
in the kernel mapping pool pages); `--no-kv-prefault` keeps the lazy pool (one sequence's
pages written). `write_zeros` maps a region on several threads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.stages.engine import Engine, EngineConfig
from kvflow.stages.serve import build
from kvflow.stages.serve.closers import Closers
from kvflow.stages.serve.colocation import decode_staging_used
from kvflow.stages.serve.config import EngineStoreConfig
from kvflow.stages.serve.embedded import EmbeddedCluster
from kvflow.stages.serve.memory import plan_memory
from kvflow.tools.args import add_engine_store_flags, engine_store_values
from kvflow.transfer import pool_memory
from kvflow.transfer.pool_memory import pool_bytes, write_zeros
from tests.conftest import pick_free_port
from tests.e2e.conftest import base_config
from tests.faults.roles import Role
from tests.stages.engine.test_resident_pages import _resident_share

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="mincore(2) as on Linux")


def _values(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_engine_store_flags(p)
    plan = SimpleNamespace(num_pages=8, staging_pages=8, dram_bytes=1 << 26, ssd_bytes=1 << 26)
    return engine_store_values(p.parse_args(argv), plan)


def test_the_flag_is_on_by_default_and_reaches_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _values([])["kv_prefault"] is True
    assert _values(["--kv-prefault"])["kv_prefault"] is True
    assert _values(["--no-kv-prefault"])["kv_prefault"] is False
    assert EngineStoreConfig().kv_prefault is True
    seen: list[EngineConfig] = []

    class FakeWorker:
        def __init__(self, name: str, engine: object, **kwargs: object) -> None:
            self.engine = engine

        def start(self) -> None:
            pass

        def stop(self) -> None:
            pass

    def fake_open(model_dir: Path, config: EngineConfig) -> object:
        seen.append(config)
        return object()

    monkeypatch.setattr(build.Engine, "open", staticmethod(fake_open))
    monkeypatch.setattr(build, "EngineWorker", FakeWorker)
    for argv, want in (([], 8), (["--no-kv-prefault"], None)):
        config = EngineStoreConfig(**_values([*argv, "--data-dir", str(tmp_path)]))
        assert build.prefill_prefault(config) == want  # the plan's 8 pages, or none
        closers = Closers()
        build.open_engine(tmp_path, config, "prefill-0", closers, None, want)
        closers.close_all()
        assert seen[-1].prefault_pages == want


def test_the_memory_line_says_whether_the_pages_are_written() -> None:
    sizes: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        max_model_len=512,
        num_params=1000,
        dtype="float32",
        block_size=16,
        engines=1,
        shards=1,
        available=1 << 30,
        free_disk=1 << 30,
    )
    line = plan_memory(**sizes).describe()
    assert "KV pages of the prefilling engine written at start" in line
    lazy = plan_memory(**sizes, kv_prefault=False).describe()
    assert "KV pages mapped as used" in lazy and "written at start" not in lazy


def test_engine_config_checks_the_field() -> None:
    assert EngineConfig().prefault_pages is None  # the library's engine stays lazy
    for bad in (True, -1, 2.0, "8"):
        with pytest.raises(ValueError, match="prefault_pages must be None or an int >= 0"):
            EngineConfig(prefault_pages=bad)  # type: ignore[arg-type]


def _shares(engine: Engine, split: int) -> tuple[float, float]:
    """Resident shares of the pool's first ``split`` pages and of the rest."""
    pool = engine.host_pool
    return _resident_share(pool[:split]), _resident_share(pool[split:])


@linux_only
def test_a_prefaulting_engine_maps_its_leading_pages_at_open(tiny_model: Path) -> None:
    def engine(prefault: int | None) -> Engine:
        config = EngineConfig(num_pages=4096, block_size=16, prefault_pages=prefault)
        return Engine.open(tiny_model, config)

    one = engine(None).resident_pages(4096)
    assert one == 256  # one 4096-token sequence of 16-token pages
    lazy_head, lazy_rest = _shares(engine(None), 1024)
    assert lazy_head < 0.3 and lazy_rest < 0.05
    written = engine(1024)
    head, rest = _shares(written, 1024)
    assert head == 1.0 and rest < 0.05
    assert int(written.host_pool.count_nonzero()) == 0
    assert _shares(engine(10), one)[0] == 1.0  # never fewer than one sequence's
    assert _shares(engine(10**6), 4095)[0] == 1.0  # at most the whole pool


@linux_only
def test_write_zeros_maps_every_page_on_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_memory, "WRITE_CHUNK", 1 << 20)  # 16 spans for 2 threads
    region = pool_bytes(16 << 20)
    assert _resident_share(torch.from_numpy(region)) < 0.05
    write_zeros(region, threads=2)
    assert _resident_share(torch.from_numpy(region)) == 1.0
    assert not region.any()
    region[::4096] = 7  # bytes already there are zeroed too
    write_zeros(region, threads=2)
    assert not region.any()
    view = region[: 3 << 20].view(np.float32)  # any dtype, through its bytes
    view[:] = 1.0
    write_zeros(view)
    assert not region.any()


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("prefill", "(64 KV pages of the prefilling engine written at start;"),
        ("decode", "(the KV pages mapped as used)"),
    ],
)
def test_a_nodes_start_line_says_what_it_writes(
    tmp_path: Path, tiny_model: Path, kind: str, said: str
) -> None:
    """A prefill node writes its pool at start; a decode node's start line does not claim to."""
    argv = [
        "--role", "node", "--kind", kind, "--node-id", f"{kind}-0", "--model", str(tiny_model),
        "--port", str(pick_free_port()), "--meta", f"127.0.0.1:{pick_free_port()}",
        "--data-dir", str(tmp_path / "data"), "--metrics-port", "0",
        "--block-size", "16", "--num-pages", "64", "--dram-mb", "32", "--ssd-mb", "64",
    ]  # fmt: skip
    role = Role(kind, argv, tmp_path / f"{kind}.log").start()
    try:
        role.wait_for(f"kvflow node {kind}-0: memory:", timeout_s=240)
        line = next(x for x in role.output().splitlines() if x.startswith("kvflow node"))
        assert said in line, line
        assert (kind == "prefill") == ("written at start" in line), line
    finally:
        role.stop()


@linux_only
def test_one_colocated_pair_leaves_its_decode_staging_unmapped(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Its decode adopts the prefill's pages in place and never leases staging slots, so none
    are written at start; disaggregated, or with several pairs, one sequence's are."""
    assert decode_staging_used(False, 1, 1) and decode_staging_used(True, 2, 2)
    assert not decode_staging_used(True, 1, 1)
    shares = {}
    for colocate in (True, False):
        data = tmp_path / f"colocate-{colocate}"
        config = base_config(tiny_model, data, colocate=colocate, staging_pages=1024)
        cluster = EmbeddedCluster(config)
        try:
            staging = cluster.decode["decode-0"].staging.tensor
            engine = cluster.decode["decode-0"].worker.engine
            one = engine.resident_pages(staging.shape[0])
            assert 0 < one < staging.shape[0]
            shares[colocate] = _resident_share(staging[:one])
            load = cluster.prefill["prefill-0"].load_staging.tensor  # prefix hits read into it
            assert _resident_share(load[:one]) == 1.0
        finally:
            cluster.close_resources()
    assert shares[False] == 1.0
    assert shares[True] < 0.05
