"""Pool memory (kvflow.transfer.pool_memory): zeroed, writable, lazily mapped, small pages.

The kernel's view of the mapping comes from /proc/self/smaps (Linux)."""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest
import torch

from kvflow.kvdb import StoreConfig
from kvflow.kvdb.dram import DramTier
from kvflow.stages.engine.pages import lazy_zeros
from kvflow.transfer.pool_memory import pool_bytes, shared_region

MIB = 1 << 20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads smaps")


def mapping_kib(address: int) -> dict[str, int]:
    """The kB fields (Rss, AnonHugePages, ...) and VmFlags of the mapping holding ``address``."""
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = lo <= address < hi
            elif inside and line.endswith("kB\n"):
                fields[head.rstrip(":")] = int(line.split()[1])
            elif inside and head == "VmFlags:":
                fields.update({flag: 1 for flag in line.split()[1:]})
    assert inside or fields, f"no mapping holds {address:#x}"
    return fields


def test_pool_bytes_is_zeroed_and_writable() -> None:
    pool = pool_bytes(3 * MIB + 5)
    assert pool.shape == (3 * MIB + 5,) and pool.dtype == np.uint8
    assert pool.flags.writeable and not pool.any()
    pool[-5:] = 7
    assert int(pool.sum()) == 35
    assert pool_bytes(0).shape == (0,)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        pool_bytes(-1)


def resident_kib(address: int, nbytes: int) -> int:
    """KiB of [address, address + nbytes) resident in memory (mincore(2)): the range alone.
    smaps' Rss is the whole mapping's, and the kernel may merge a new mapping with a
    neighbour of the same flags (another pool a test left to the collector): a run of the
    suite on a loaded machine once saw 4,768 KiB resident in a pool nothing had written."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    length = address + nbytes - start
    vec = (ctypes.c_ubyte * -(-length // page))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * page // 1024


@linux_only
def test_pool_bytes_is_mapped_as_written_in_small_pages() -> None:
    pool = pool_bytes(64 * MIB)
    address = pool.ctypes.data
    assert mapping_kib(address).get("nh") == 1, "the mapping is not marked MADV_NOHUGEPAGE"
    assert resident_kib(address, 64 * MIB) < 4 * 1024  # nothing written: (almost) none resident
    pool[: 16 * MIB] = 1  # write 16 MiB, 2 MiB aligned or not
    assert 16 * 1024 <= resident_kib(address, 64 * MIB) < 24 * 1024
    assert mapping_kib(address)["AnonHugePages"] == 0


@linux_only
def test_the_kv_page_pool_and_the_dram_tier_are_pool_memory() -> None:
    kv = lazy_zeros((32, 1, 2, 2, 16, 64), torch.float32, torch.device("cpu"), resident=2)
    assert not kv.any()  # reading maps zero pages; the bytes are zero
    assert mapping_kib(kv.data_ptr()).get("nh") == 1
    tier = DramTier(8 * MIB, 256)
    assert mapping_kib(tier.pool.ctypes.data).get("nh") == 1
    assert shared_region(tier.pool) is not None  # same-host peers can be handed it
    private = DramTier(8 * MIB, 256, shared=False)  # the embedded server's shards
    assert shared_region(private.pool) is None
    assert mapping_kib(private.pool.ctypes.data).get("nh") == 1
    with pytest.raises(ValueError, match="dram_shared must be a bool"):
        StoreConfig(engine="memory", dram_shared="yes")  # type: ignore[arg-type]
