"""SGLang's HiCache storage contract, imported without the rest of SGLang.

``sglang/__init__.py`` imports the whole runtime (triton, CUDA kernels, transformers patches).
The contract module ``sglang.srt.mem_cache.hicache_storage`` needs only torch and
``sglang.srt.environ`` (stdlib only). Inside a running SGLang server ``sglang`` is already
imported and the real module is used as is. Elsewhere (tests, a CPU-only environment with
sglang installed ``--no-deps``) the top-level package is entered as an unexecuted module
object so that only the contract and what it imports run. A later ``import sglang`` in such a
process gets that shell: load the full SGLang first if both are needed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

CONTRACT_MODULE = "sglang.srt.mem_cache.hicache_storage"
METRICS_MODULE = "sglang.srt.observability.metrics_collector"


def load_contract() -> ModuleType:
    """The ``hicache_storage`` module (HiCacheStorage, HiCacheStorageConfig,
    HiCacheStorageExtraInfo). Raises ImportError if sglang is not installed."""
    loaded = sys.modules.get(CONTRACT_MODULE)
    if loaded is not None:
        return loaded
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(
                "sglang is not installed: pip install --no-deps -c constraints.txt sglang"
            )
        sys.modules["sglang"] = importlib.util.module_from_spec(spec)  # not executed
    return importlib.import_module(CONTRACT_MODULE)


@dataclass
class FallbackStorageMetrics:
    """The fields of SGLang's ``StorageMetrics``, used where its metrics module is not
    loaded (it imports the scheduler's runtime)."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def new_storage_metrics() -> Any:
    """An empty SGLang ``StorageMetrics`` (its metrics collector asserts the type) when that
    module is loaded in this process, else a ``FallbackStorageMetrics``."""
    module = sys.modules.get(METRICS_MODULE)
    cls = getattr(module, "StorageMetrics", None) if module is not None else None
    return cls() if cls is not None else FallbackStorageMetrics()


__all__ = ["FallbackStorageMetrics", "load_contract", "new_storage_metrics"]
