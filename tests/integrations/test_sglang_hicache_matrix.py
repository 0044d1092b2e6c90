"""Every host pool layout SGLang offers, MHA and MLA, written through one of SGLang's cache
controller page paths and read through the other: bit-exact, or refused with a clear error.

SGLang's own code runs throughout (kvflow/tools/bench/sglang_source.py): the host pools'
``init_kv_buffer``, ``get_page_buffer_meta``, ``get_data_page``, ``get_dummy_flat_data_page`` and
``set_from_flat_data_page``; the controller's ``attach_storage_backend``,
``_page_set_zero_copy`` / ``_generic_page_set`` (backup) and ``_page_get_zero_copy`` /
``_generic_page_get`` (prefetch); the backend factory and ``HiCacheStorageConfig``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from kvflow.tools.bench.sglang_source import bare_controller, host_pool, prefetch_operation
from tests.integrations.conftest import create_backend, storage_config
from tests.integrations.sglang_docs import doc_block
from tests.integrations.sglang_pools import fill, indices, make_pool, page

# read from the installed sglang 0.5.23: pool_host/mha.py and mla.py init_kv_buffer
SUPPORTED = [
    ("mha", "layer_first"),
    ("mha", "page_first"),
    ("mha", "page_first_direct"),
    ("mha", "page_head"),
    ("mla", "layer_first"),
    ("mla", "page_first"),
    ("mla", "page_first_direct"),
]
# host pools SGLang builds on CPU for which its get_page_buffer_meta gives no segments
REFUSED = [("mha", "page_unified"), ("mla", "page_unified")]
PATHS = ["v1", "generic"]
MEMBER = {"kvflow_node_id": "n0", "kvflow_engine": "memory"}


def _attach(kind: str, layout: str, extra: dict[str, Any]) -> tuple[Any, Any]:
    """A real SGLang host pool and a controller with kvflow attached the way SGLang's
    scheduler attaches it (``attach_storage_backend("dynamic", ...)``)."""
    pool = make_pool(kind, layout)

    def config(model_name: str | None, extra_config: dict[str, Any] | None) -> Any:
        return storage_config(kind == "mla", model_name or "org/model-a", **(extra_config or {}))

    ctl = bare_controller(pool, config)
    ctl.attach_storage_backend(
        "dynamic", model_name="org/model-a", storage_backend_extra_config=extra
    )
    return pool, ctl


def _write(ctl: Any, path: str, keys: list[str], host: torch.Tensor) -> bool:
    if path == "v1":
        return ctl._page_set_zero_copy(keys, host)
    return ctl._generic_page_set(keys, host)


def _read(ctl: Any, path: str, keys: list[str], host: torch.Tensor) -> int:
    op = prefetch_operation()
    if path == "v1":
        return ctl._page_get_zero_copy(op, keys, host)
    return ctl._generic_page_get(op, keys, host)


@pytest.mark.parametrize("reader", PATHS)
@pytest.mark.parametrize("writer", PATHS)
@pytest.mark.parametrize(("kind", "layout"), SUPPORTED)
def test_written_on_one_path_read_on_the_other_bit_exact(
    kind: str, layout: str, writer: str, reader: str
) -> None:
    pool, ctl = _attach(kind, layout, {**doc_config(), **MEMBER})
    try:
        fill(pool, seed=7)
        ps = pool.page_size
        written = {p: page(pool, p) for p in (1, 2, 3)}
        keys = ["hash-a", "hash-b", "hash-c"]
        assert _write(ctl, writer, keys, indices([1, 2, 3], ps))
        pool.kv_buffer.zero_()
        # other slots, another order; a page never written ends the prefetch there
        assert _read(ctl, reader, ["hash-c", "hash-a", "hash-b"], indices([9, 5, 12], ps)) == 3
        for src, dst in ((3, 9), (1, 5), (2, 12)):
            assert torch.equal(page(pool, dst), written[src]), (src, dst)
        # (slot 8, past the miss, is SGLang's to free: the v1 path may have filled it)
        assert _read(ctl, reader, ["hash-b", "nope", "hash-a"], indices([6, 7, 8], ps)) == 1
        assert torch.equal(page(pool, 6), written[2])
        for untouched in (0, 4, 7, 10, 11, 13):
            assert torch.count_nonzero(page(pool, untouched).float()) == 0, untouched
    finally:
        ctl.storage_backend.close()


@pytest.mark.parametrize(("kind", "layout"), SUPPORTED)
def test_k_and_v_land_where_sglang_put_them(kind: str, layout: str) -> None:
    """A page whose every segment holds a distinct constant comes back with each constant in
    its place, on both paths (a swapped K/V or layer would show here even where the
    random-data test could not tell which segment went where)."""
    pool, ctl = _attach(kind, layout, {**doc_config(), **MEMBER})
    try:
        ps = pool.page_size
        ptrs, sizes = pool.get_page_buffer_meta(indices([2], ps))
        flat = pool.kv_buffer.view(-1).view(torch.uint8)
        base = pool.kv_buffer.data_ptr()
        for i, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
            flat[ptr - base : ptr - base + size] = i + 1
        expected = page(pool, 2)
        assert _write(ctl, "generic", ["g"], indices([2], ps))
        assert _write(ctl, "v1", ["z"], indices([2], ps))
        pool.kv_buffer.zero_()
        assert _read(ctl, "v1", ["g"], indices([4], ps)) == 1
        assert _read(ctl, "generic", ["z"], indices([6], ps)) == 1
        assert torch.equal(page(pool, 4), expected)
        assert torch.equal(page(pool, 6), expected)
    finally:
        ctl.storage_backend.close()


@pytest.mark.parametrize(("kind", "layout"), REFUSED)
def test_layouts_without_page_segments_are_refused_at_attach(kind: str, layout: str) -> None:
    with pytest.raises(ValueError, match=rf"layout '{layout}' is not supported.*supported: MHA"):
        _attach(kind, layout, {**doc_config(), **MEMBER})


def test_decode_context_parallel_host_pools_are_refused_at_attach() -> None:
    pool = host_pool("mla", "page_first", dcp_size=2)
    assert pool.dcp_size == 2 and pool.logical_page_size == 4  # SGLang's DCP sizing ran
    with pytest.raises(ValueError, match=r"dcp_size=2: decode-context-parallel"):
        create_backend(pool, True, **MEMBER)


def doc_config() -> dict[str, Any]:
    """docs/sglang.md's extra config without the member's own options (cluster addresses,
    data dir, tier sizes): here an embedded in-memory store (MEMBER)."""
    config = json.loads(doc_block("sglang.md", "hicache-extra-config"))
    assert config["kvflow_meta"] and config["kvflow_data_dir"]
    return {k: v for k, v in config.items() if not k.startswith("kvflow_")}


def test_documented_config_takes_sglangs_zero_copy_path() -> None:
    config = doc_config()
    assert config["interface_v1"] == 1
    _, ctl = _attach("mha", "page_first", {**config, **MEMBER})
    try:
        assert ctl.enable_storage
        assert ctl.page_get_func == ctl._page_get_zero_copy
        assert ctl.page_set_func == ctl._page_set_zero_copy
    finally:
        ctl.storage_backend.close()
    without = {k: v for k, v in config.items() if k != "interface_v1"}
    _, ctl = _attach("mha", "page_first", {**without, **MEMBER})
    try:
        assert ctl.page_get_func == ctl._generic_page_get  # and it is bit-exact too (above)
    finally:
        ctl.storage_backend.close()
