"""The embedded server maps each DRAM tier ahead of its stores while its engine is idle
(``--dram-write-ahead-mb``, ``kvdb/dram.py``): after a prompt's blocks are stored, the span
past them is resident before the next prompt, bounded by the reserve; an unused tier stays
unmapped; 0 turns it off; the flag reaches the config."""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

import pytest

from kvflow.stages.serve.config import DRAM_WRITE_AHEAD_BYTES, EngineStoreConfig
from kvflow.tools.args import add_engine_store_flags, engine_store_values
from tests.kvdb.test_dram_write_ahead import resident

DEADLINE_S = 60.0
MIB = 1 << 20


def _marks_settle(shard, want_mapped, deadline_s: float = DEADLINE_S) -> tuple[int, int]:
    """The shard's (high water, mapped) once ``want_mapped(high, mapped)``; fails after the
    deadline with the last marks."""
    end = time.monotonic() + deadline_s
    marks = shard.dram_marks()
    while not want_mapped(*marks):
        assert time.monotonic() < end, f"DRAM marks stayed at {marks}"
        time.sleep(0.05)
        marks = shard.dram_marks()
    return marks


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE, mincore")
@pytest.mark.parametrize("colocate", [True, False])
def test_an_idle_engine_maps_the_tier_past_its_stores(make_server, colocate) -> None:
    reserve = 8 * MIB
    server = make_server(colocate=colocate, dram_write_ahead_bytes=reserve)
    prefill = server.cluster.prefill["prefill-0"].store.shard
    decode = server.cluster.decode["decode-0"].store.shard
    assert prefill.dram_marks() == (0, 0)  # nothing stored: nothing mapped
    ids, _, _ = server.generate(list(range(5, 70)), max_tokens=2)
    assert len(ids) == 2
    high, mapped = _marks_settle(prefill, lambda h, m: h > 0 and m == h + reserve)
    assert resident(prefill.dram_pool, high, mapped) == 1.0
    capacity = server.config.dram_capacity_bytes
    assert resident(prefill.dram_pool, mapped + MIB, capacity) < 0.1  # the reserve only
    assert decode.dram_marks() == (0, 0)  # a tier nothing was stored in stays unmapped
    # the next prompt's blocks land in the mapped span; the reserve moves on past them
    server.generate(list(range(100, 170)), max_tokens=2)
    _marks_settle(prefill, lambda h, m: h > high and m == h + reserve)


def test_zero_turns_it_off(make_server) -> None:
    server = make_server(dram_write_ahead_bytes=0)
    prefill = server.cluster.prefill["prefill-0"]
    assert prefill.store.shard.write_ahead not in prefill.worker._idle_tasks  # no such chore
    server.generate(list(range(5, 70)), max_tokens=2)
    _marks_settle(prefill.store.shard, lambda h, m: h > 0 and m == 0)


def test_the_flag_reaches_the_config() -> None:
    p = argparse.ArgumentParser()
    add_engine_store_flags(p)
    plan = SimpleNamespace(num_pages=8, staging_pages=8, dram_bytes=1 << 26, ssd_bytes=1 << 26)

    def values(argv: list[str]) -> int:
        return engine_store_values(p.parse_args(argv), plan)["dram_write_ahead_bytes"]

    assert values([]) == DRAM_WRITE_AHEAD_BYTES == EngineStoreConfig().dram_write_ahead_bytes
    assert values(["--dram-write-ahead-mb", "64"]) == 64 * MIB
    assert values(["--dram-write-ahead-mb", "0"]) == 0
    with pytest.raises(ValueError, match="--dram-write-ahead-mb must be >= 0"):
        values(["--dram-write-ahead-mb", "-1"])
    with pytest.raises(ValueError, match="dram_write_ahead_bytes must be an int >= 0"):
        EngineStoreConfig(dram_write_ahead_bytes=-5)
