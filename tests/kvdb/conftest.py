"""Fixtures for kvdb: a small layout, namespaces, shards and stores closed at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvflow.kvdb import (
    DEFAULT_TENANT,
    KVLayout,
    Namespace,
    Shard,
    Store,
    StoreConfig,
    codec,
    open_store,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
NBYTES = LAYOUT.block_nbytes  # 1024
NAMESPACE = Namespace("tenant-a", "demo-llama:0123abcd:bfloat16", LAYOUT)
RECORD = NBYTES + codec.HEADER_BYTES + len(DEFAULT_TENANT)
"""An uncompressed SSD record of one block of the default tenant (``Shard.put``'s)."""


def value(i: int, nbytes: int = NBYTES) -> np.ndarray:
    """A deterministic value for block ``i``."""
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def keys(n: int, tenant: str = "tenant-a") -> list[bytes]:
    """``n`` chained keys of ``tenant`` in NAMESPACE's model."""
    from kvflow.kvdb import block_keys

    ns = Namespace(tenant, NAMESPACE.model_fingerprint, LAYOUT)
    return list(block_keys(ns, list(range(n * LAYOUT.block_size))))


def config(tmp_path: Path, **overrides: Any) -> StoreConfig:
    """A small store: DRAM for 8 blocks, SSD for 16 records, memory engine unless told."""
    fields: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "dram_capacity_bytes": 8 * NBYTES,
        "ssd_capacity_bytes": 16 * RECORD,
        "engine": "memory",
        "high_watermark": 1.0,
        "low_watermark": 0.75,
    }
    fields.update(overrides)
    return StoreConfig(**fields)


ShardFactory = Callable[..., Shard]


@pytest.fixture
def make_shard(tmp_path: Path) -> Iterator[ShardFactory]:
    """make_shard(**config overrides, replicas=..., engine=...) -> Shard; all closed after."""
    opened: list[Shard] = []

    def factory(replicas: Any = None, engine: Any = None, **overrides: Any) -> Shard:
        shard = Shard(
            config(tmp_path, **overrides),
            NAMESPACE.fingerprint(),
            replicas=replicas,
            shuffle_bytes=2,
            engine=engine,
        )
        opened.append(shard)
        return shard

    yield factory
    for shard in opened:
        shard.close()


StoreFactory = Callable[..., Store]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[StoreFactory]:
    """make_store(config, metadata=None) -> Store; all closed after."""
    opened: list[Store] = []

    def factory(cfg: StoreConfig, metadata: Any = None, namespace: Any = NAMESPACE) -> Store:
        store = open_store(cfg, namespace, metadata=metadata)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()
