"""The embedded server writes a half-full DRAM tier's coldest blocks to its SSD tier while
its engine is idle (``--dram-write-behind``, ``Shard.write_behind``): they stay in DRAM, an
eviction later drops their DRAM copies, and the records read back from SSD hold the same
bytes; ``--no-dram-write-behind`` turns it off; the flag reaches the config."""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np

from kvflow.replication import Tier
from kvflow.stages.serve.config import EngineStoreConfig
from kvflow.tools.args import add_engine_store_flags, engine_store_values
from tests.e2e.conftest import BLOCK

DEADLINE_S = 60.0
PAGE = 2 * 2 * 2 * BLOCK * 16 * 4
"""One block of the tiny demo model: 2 layers x K/V x 2 KV heads x 16 tokens x 16 dims x 4 B."""
TIER_BLOCKS = 16


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7 + 3 * i) % 300 + 5 for i in range(blocks * BLOCK + 3)]


def wait_for(check, what: str, deadline_s: float = DEADLINE_S):
    end = time.monotonic() + deadline_s
    while not (value := check()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_an_idle_engine_writes_the_tiers_blocks_behind(make_server) -> None:
    server = make_server(dram_capacity_bytes=TIER_BLOCKS * PAGE)
    shard = server.cluster.prefill["prefill-0"].store.shard
    assert shard.dram_pool is not None and server.config.dram_write_behind
    first = prompt(1, 6)
    server.generate(first, max_tokens=4)
    assert shard.write_behind() == 0  # 6 of 16 blocks: not yet
    assert shard.stats().ssd.bytes_written == 0
    server.generate(prompt(2, 4), max_tokens=4)  # 10 of 16 blocks: past half
    stats = wait_for(
        lambda: (s := shard.stats()).ssd.blocks >= 10 and s, "10 blocks written behind"
    )
    assert stats.dram.blocks == 10 and stats.dram.demotions == 0  # still in DRAM
    held = {key: read(shard, key) for key, tier in shard.holdings() if tier is Tier.DRAM}
    assert len(held) == 10
    # more prompts: evictions leave some of those blocks on SSD only
    server.generate(prompt(3, 4), max_tokens=4)
    server.generate(prompt(4, 4), max_tokens=4)
    wait_for(lambda: shard.stats().dram.demotions > 0, "an eviction")
    moved = [key for key, tier in shard.holdings() if tier is Tier.SSD and key in held]
    assert moved
    hits = shard.stats().ssd.hits
    for key in moved:  # the records written behind hold the blocks' bytes (checksum verified)
        assert (read(shard, key) == held[key]).all()
    assert shard.stats().ssd.hits == hits + len(moved)
    server.generate(first, max_tokens=4)  # a request reusing them is served


def read(shard, key: bytes) -> np.ndarray:
    """A copy of ``key``'s block, from whichever tier holds it."""
    (size,) = shard.value_sizes([key])
    out = np.zeros(size, dtype=np.uint8)
    assert shard.get_into(key, out) is not None
    return out


def test_no_dram_write_behind_turns_it_off(make_server) -> None:
    server = make_server(dram_capacity_bytes=TIER_BLOCKS * PAGE, dram_write_behind=False)
    prefill = server.cluster.prefill["prefill-0"]
    assert prefill.store.shard.write_behind not in prefill.worker._idle_tasks
    server.generate(prompt(1, 10), max_tokens=2)
    assert prefill.store.shard.write_behind() == 0  # off in the shard's config too
    assert prefill.store.shard.stats().ssd.bytes_written == 0


def test_the_flag_reaches_the_config() -> None:
    p = argparse.ArgumentParser()
    add_engine_store_flags(p)
    plan = SimpleNamespace(num_pages=8, staging_pages=8, dram_bytes=1 << 26, ssd_bytes=1 << 26)

    def value(argv: list[str]) -> bool:
        return engine_store_values(p.parse_args(argv), plan)["dram_write_behind"]

    assert value([]) is True is EngineStoreConfig().dram_write_behind
    assert value(["--no-dram-write-behind"]) is False
    assert value(["--dram-write-behind"]) is True
