"""`--dram-prefault`: the flag reaches each shard's StoreConfig, and a DRAM tier opened that
way is resident at once (its pages written at open, not by the first stores)."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvflow.kvdb import StoreConfig
from kvflow.kvdb.dram import DramTier
from kvflow.stages.serve import build
from kvflow.stages.serve.closers import Closers
from kvflow.stages.serve.config import EngineStoreConfig
from kvflow.tools.args import add_engine_store_flags, engine_store_values


def _values(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_engine_store_flags(p)
    plan = SimpleNamespace(num_pages=8, staging_pages=8, dram_bytes=1 << 26, ssd_bytes=1 << 26)
    return engine_store_values(p.parse_args(argv), plan)


def test_the_flag_reaches_the_shard_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _values([])["dram_prefault"] is False
    values = _values(["--dram-prefault", "--data-dir", str(tmp_path)])
    assert values["dram_prefault"] is True
    config = EngineStoreConfig(**values)
    seen: list[StoreConfig] = []

    class FakeStore:
        def close(self) -> None:
            pass

    def fake_open_store(store_config: StoreConfig, *args: object, **kwargs: object) -> FakeStore:
        seen.append(store_config)
        return FakeStore()

    monkeypatch.setattr(build, "open_store", fake_open_store)
    monkeypatch.setattr(build, "kv_layout", lambda engine: None)
    monkeypatch.setattr(build, "namespace_for", lambda *args: "ns")
    engine = SimpleNamespace(page_nbytes=4096, model_fingerprint="fp")
    closers = Closers()
    build.open_shard(config, "prefill-0", engine, None, closers)  # type: ignore[arg-type]
    assert len(seen) == 1 and seen[0].dram_prefault is True


def _resident_bytes(tier: DramTier) -> int:
    """Bytes of the tier's mapping resident now (/proc/self/smaps: its Rss line)."""
    start = tier.pool.ctypes.data
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and int(head.split("-")[0], 16) == start:
            for follow in lines[i + 1 :]:
                if follow.startswith("Rss:"):
                    return int(follow.split()[1]) * 1024
    raise AssertionError("the tier's mapping is not in smaps")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_a_prefaulted_tier_is_resident_at_open() -> None:
    size = 32 << 20
    lazy, written = DramTier(size, 4096), DramTier(size, 4096, prefault=True)
    assert _resident_bytes(lazy) < size // 8
    assert _resident_bytes(written) >= size
