"""The SGLang HiCache backend on an embedded kvflow store, driven as SGLang's cache
controller drives it (real HiCacheStorage base class and backend factory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.integrations.sglang_hicache import HiCacheStorage, KvflowHiCacheStorage
from tests.integrations.conftest import create_backend
from tests.integrations.sglang_pools import fill, indices, make_pool, page

LAYOUTS = [
    ("mha", "page_first"),
    ("mha", "layer_first"),
    ("mha", "page_first_direct"),
    ("mha", "page_head"),
    ("mla", "page_first"),
    ("mla", "layer_first"),
    ("mla", "page_first_direct"),
]


def _backend(kind: str, layout: str, tmp_path: Path, **extra):
    pool = make_pool(kind, layout)
    backend = create_backend(
        pool, kind == "mla", kvflow_node_id="n0", kvflow_engine="memory", **extra
    )
    return pool, backend


def test_dynamic_factory_builds_a_real_subclass(tmp_path: Path) -> None:
    _, backend = _backend("mha", "page_first", tmp_path)
    try:
        assert isinstance(backend, KvflowHiCacheStorage)
        assert issubclass(KvflowHiCacheStorage, HiCacheStorage)
        assert HiCacheStorage.__module__ == "sglang.srt.mem_cache.hicache_storage"
        assert backend.keys.geometry.segments == 2  # K and V
    finally:
        backend.close()


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS)
def test_pages_round_trip_bit_exact_between_pool_slots(
    kind: str, layout: str, tmp_path: Path
) -> None:
    pool, backend = _backend(kind, layout, tmp_path)
    try:
        fill(pool, seed=1)
        ps = pool.page_size
        written = {p: page(pool, p) for p in (0, 1, 2)}
        keys = ["h0", "h1", "h2"]
        assert backend.batch_set_v1(keys, indices([0, 1, 2], ps)) == [True] * 3
        pool.kv_buffer.zero_()
        # read them into other slots, in another order
        assert backend.batch_get_v1(["h2", "h0", "h1"], indices([5, 7, 9], ps)) == [True] * 3
        for src, dst in ((2, 5), (0, 7), (1, 9)):
            assert torch.equal(pool.get_data_page(dst * ps), written[src])
        untouched = pool.get_data_page(6 * ps)
        assert torch.count_nonzero(untouched.float()) == 0
    finally:
        backend.close()


def test_batch_exists_counts_leading_pages_and_stops_at_holes(tmp_path: Path) -> None:
    pool, backend = _backend("mha", "layer_first", tmp_path)
    try:
        fill(pool, seed=2)
        ps = pool.page_size
        assert backend.batch_exists([]) == 0
        assert backend.batch_exists(["a"]) == 0
        backend.batch_set_v1(["a", "b", "c", "e"], indices([0, 1, 2, 3], ps))
        assert backend.batch_exists(["a", "b", "c", "d", "e"]) == 3  # hole at d
        assert backend.batch_exists(["b", "c"]) == 2
        assert backend.batch_exists(["d", "a"]) == 0
        assert backend.exists("e") and not backend.exists("d")
        # a page with one missing segment (here: layer 1's V) is a hole too
        seg_keys = backend.keys.of("b")
        assert len(seg_keys) == 2 * pool.layer_num
        assert backend.member.remove([seg_keys[3]]) == 1
        assert backend.batch_exists(["a", "b", "c"]) == 1
        assert backend.batch_get_v1(["a", "b"], indices([8, 9], ps)) == [True, False]
    finally:
        backend.close()


def test_misses_and_broken_contract_return_false_without_raising(tmp_path: Path) -> None:
    pool, backend = _backend("mla", "page_first", tmp_path)
    try:
        ps = pool.page_size
        assert backend.batch_get_v1(["nope"], indices([0], ps)) == [False]
        # indices that do not cover one page per key: the batch fails, nothing is stored
        assert backend.batch_set_v1(["x", "y"], indices([0], ps)) == [False, False]
        assert backend.batch_exists(["x"]) == 0
        assert backend.batch_get_v1([], indices([], ps)) == []
    finally:
        backend.close()


def test_single_page_get_set_and_clear(tmp_path: Path) -> None:
    pool, backend = _backend("mha", "page_first", tmp_path)
    try:
        data = torch.randn(backend.keys.geometry.page_bytes() // 2).to(torch.bfloat16)
        assert backend.set("p", data)
        assert backend.exists("p")
        out = torch.zeros_like(data)
        assert backend.get("p", out) is out and torch.equal(out, data)
        assert backend.get("q", torch.zeros_like(data)) is None
        assert not backend.set("bad", torch.zeros(3, dtype=torch.bfloat16))  # wrong size
        # set of a flat page == the pool's page_first data page layout: batch_get_v1 agrees
        assert backend.batch_get_v1(["p"], indices([4], pool.page_size)) == [True]
        assert torch.equal(pool.get_data_page(4 * pool.page_size).reshape(-1), data)
        backend.clear()
        assert not backend.exists("p")
    finally:
        backend.close()


def test_stats_report_pages_bandwidth_and_tiers(tmp_path: Path) -> None:
    pool, backend = _backend("mha", "page_first", tmp_path)
    try:
        fill(pool, seed=3)
        ps = pool.page_size
        backend.batch_set_v1(["a", "b"], indices([0, 1], ps))
        backend.batch_get_v1(["a", "b", "c"], indices([2, 3, 4], ps))
        stats = backend.get_stats()
        assert stats.backup_pgs == [2] and stats.prefetch_pgs == [2]
        assert stats.prefetch_bandwidth[0] > 0
        assert stats.kvflow_tiers == {"dram": 4, "ssd": 0, "remote": 0, "miss": 2}
        again = backend.get_stats()  # read and reset
        assert again.prefetch_pgs == [] and again.kvflow_tiers["dram"] == 0
    finally:
        backend.close()


def test_pages_survive_a_restart_on_ssd(tmp_path: Path) -> None:
    pool = make_pool("mla", "layer_first")
    fill(pool, seed=4)
    ps = pool.page_size
    expected = page(pool, 0)
    cfg = {"kvflow_node_id": "n0", "kvflow_data_dir": str(tmp_path), "kvflow_engine": "rocksdb"}
    first = create_backend(pool, True, **cfg)
    assert first.batch_set_v1(["a"], indices([0], ps)) == [True]
    first.close()
    pool.kv_buffer.zero_()
    second = create_backend(pool, True, **cfg)
    try:
        assert second.batch_exists(["a"]) == 1
        assert second.batch_get_v1(["a"], indices([3], ps)) == [True]
        assert torch.equal(pool.get_data_page(3 * ps), expected)
        # another model on the same data dir is refused, never served
        with pytest.raises(Exception, match=r"fingerprint|model"):
            create_backend(pool, True, model="org/other", **cfg)
    finally:
        second.close()
