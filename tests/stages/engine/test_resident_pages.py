"""A lazily mapped KV pool (and staging area) maps one sequence's pages at start-up, so the
first request that uses them takes no page faults (issue 31: the first prefix hit on a fresh
server faulted its reuse-load staging in, 0.2-0.3 s of its TTFT)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow.stages.engine.pages import RESIDENT_TOKENS, KVLayout, PagePool, resident_pages
from kvflow.stages.runtime.staging import StagingArea

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="mincore(2) as on Linux")

# 1 MiB pages; 64 of them are above glibc's largest mmap threshold (32 MiB), so the pool is a
# fresh anonymous mapping whose untouched pages are not resident
LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=128, dtype="float32")
NUM_PAGES = 64


def _resident_share(t: torch.Tensor) -> float:
    """The share of the OS pages wholly inside ``t`` that are resident (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    os_page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // os_page) * os_page, end // os_page * os_page
    n = (last - first) // os_page
    assert n > 0
    vec = (ctypes.c_ubyte * n)()
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(last - first), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) / n


def test_resident_pages_are_one_sequence() -> None:
    assert RESIDENT_TOKENS == 4096
    assert resident_pages(273, 64, 8192) == 64  # 4096 tokens of 64-token pages
    assert resident_pages(273, 64, 2000) == 32  # a shorter model: its whole length
    assert resident_pages(10, 64, 8192) == 10  # never more than the pool
    assert resident_pages(273, 16, 100) == 7


def _shares_in_a_fresh_process() -> dict[str, float]:
    """Resident shares of a pool and a staging area built in a new interpreter: in one that
    has run other tests, calloc may hand out recycled (already resident) heap memory."""
    script = (
        "import json, torch\n"
        "from tests.stages.engine import test_resident_pages as t\n"
        "print(json.dumps(t._measure()))\n"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure() -> dict[str, float]:
    cpu = torch.device("cpu")
    pool = PagePool(NUM_PAGES, LAYOUT, torch.float32, cpu, resident=8)
    lazy = PagePool(NUM_PAGES, LAYOUT, torch.float32, cpu)
    area = StagingArea("p0", NUM_PAGES, LAYOUT.page_shape, torch.float32, resident=5)
    return {
        "pool_head": _resident_share(pool.tensor[:8]),
        "pool_rest": _resident_share(pool.tensor[8:]),
        "pool_head_zero": float(torch.count_nonzero(pool.tensor[:8]) == 0),
        "lazy": _resident_share(lazy.tensor),
        "area_head": _resident_share(area.tensor[:5]),
        "area_rest": _resident_share(area.tensor[5:]),
    }


@linux_only
def test_pool_and_staging_map_their_resident_pages_at_start() -> None:
    assert LAYOUT.page_shape[0] * 2 * 4 * 128 * 64 * 4 == 1 << 20
    shares = _shares_in_a_fresh_process()
    assert shares["pool_head"] == 1.0 and shares["pool_head_zero"] == 1.0
    assert shares["pool_rest"] < 0.05  # the rest is mapped as it is written
    assert shares["lazy"] < 0.05  # resident=0: nothing mapped
    assert shares["area_head"] == 1.0
    assert shares["area_rest"] < 0.05


def test_the_resident_pages_and_slots_are_handed_out_first() -> None:
    cpu = torch.device("cpu")
    pool = PagePool(NUM_PAGES, LAYOUT, torch.float32, cpu, resident=8)
    assert pool.allocate(8) == list(range(8))
    area = StagingArea("p0", NUM_PAGES, LAYOUT.page_shape, torch.float32, resident=5)
    assert sorted(area.lease(5).slots) == list(range(5))
