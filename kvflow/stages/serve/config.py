"""ServeConfig: everything the embedded cluster is built from (one frozen record)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _positive_or_none(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, int | float) and value > 0):
        raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")


@dataclass(frozen=True)
class ServeConfig:
    """The embedded cluster: N prefill and M decode instances in one process.

    Fields:
        model_dir: a Hugging Face model directory (config.json, model.safetensors,
            tokenizer.json). None: the small demo model under ``data_dir/models/small``.
        data_dir: root of everything persistent (shards, metadata journal, demo model).
        num_prefill / num_decode: instances of each kind; each has its own engine.
        policy: routing policy name (see ``kvflow.router.policy_names()``).
        dtype: engine dtype; block_size: tokens per KV page and cached block.
        num_pages: KV pages per engine; prefill_chunk: tokens per prefill step.
        max_batch: decode batch cap per engine.
        staging_pages: page slots of each decode instance's staging area.
        dram_capacity_bytes / ssd_capacity_bytes: per-shard tier capacities.
        storage_engine: "rocksdb" (default) or "lmdb" for the SSD tier.
        ttft_slo_s / tbt_slo_s: reject requests predicted to miss them (None: no SLO).
        balancing_threshold: the conductor's kvcache_balancing_threshold (ratio >= 1).
        default_max_tokens / max_tokens_limit: for requests that give none / the most allowed.
        queue_size: bounded queue in front of each stage; a full first queue rejects with
            RESOURCE_EXHAUSTED.
        trace_capacity: requests whose spans are kept for ``kvflow trace export``.
        request_timeout_s: deadline of one request.
        seed: seeds the engines and the router.
    """

    model_dir: Path | None = None
    data_dir: Path = Path("data")
    num_prefill: int = 1
    num_decode: int = 1
    policy: str = "cache-aware"
    dtype: str = "float32"
    block_size: int = 64
    num_pages: int = 512
    prefill_chunk: int = 512
    max_batch: int = 32
    staging_pages: int = 512
    dram_capacity_bytes: int = 1 << 30
    ssd_capacity_bytes: int = 8 << 30
    storage_engine: str = "rocksdb"
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    balancing_threshold: float = 2.0
    default_max_tokens: int = 64
    max_tokens_limit: int = 4096
    queue_size: int = 256
    trace_capacity: int = 1024
    request_timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_prefill",
            "num_decode",
            "block_size",
            "num_pages",
            "prefill_chunk",
            "max_batch",
            "staging_pages",
            "dram_capacity_bytes",
            "ssd_capacity_bytes",
            "default_max_tokens",
            "max_tokens_limit",
            "queue_size",
            "trace_capacity",
        ):
            _positive_int(name, getattr(self, name))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.storage_engine not in ("rocksdb", "lmdb", "memory"):
            raise ValueError(
                f"storage_engine must be rocksdb, lmdb or memory, got {self.storage_engine!r}"
            )
        _positive_or_none("ttft_slo_s", self.ttft_slo_s)
        _positive_or_none("tbt_slo_s", self.tbt_slo_s)
        _positive_or_none("request_timeout_s", self.request_timeout_s)
        if not self.balancing_threshold >= 1.0:
            raise ValueError(f"balancing_threshold must be >= 1, got {self.balancing_threshold!r}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must be <= max_tokens_limit")
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.model_dir is not None:
            object.__setattr__(self, "model_dir", Path(self.model_dir))
