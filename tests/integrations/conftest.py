"""Helpers for the integrations tests: SGLang's real storage contract and config (sglang is
installed --no-deps by `make`, see constraints.txt; a missing sglang fails these tests)."""

from __future__ import annotations

from typing import Any

from kvflow.integrations.sglang_contract import load_contract

BACKEND = {
    "backend_name": "kvflow",
    "module_path": "kvflow.integrations.sglang_hicache",
    "class_name": "KvflowHiCacheStorage",
}


def storage_config(is_mla: bool, model: str = "org/model-a", **extra: Any) -> Any:
    """SGLang's real HiCacheStorageConfig, as its cache controller builds it."""
    contract = load_contract()
    return contract.HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=True,
        is_page_first_layout=False,
        model_name=model,
        extra_config={**BACKEND, **extra},
    )


def create_backend(pool: Any, is_mla: bool, model: str = "org/model-a", **extra: Any) -> Any:
    """What SGLang's HiCacheController.attach_storage_backend does for ``dynamic``."""
    load_contract()  # sglang's contract without the runtime (before any sglang import)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(is_mla, model, **extra), pool
    )
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend
