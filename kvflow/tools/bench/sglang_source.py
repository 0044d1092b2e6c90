"""SGLang's own host pools and cache-controller page paths, run from the installed package.

SGLang's host pool modules (``sglang/srt/mem_cache/pool_host/mha.py``, ``mla.py``) and its
cache controller import the device runtime at module level (``memory_pool`` -> the model
configs -> torchvision, whose PyPI wheels need a CUDA torch). The methods the HiCache storage
contract runs on are plain torch code: this module compiles the classes' own source, from the
installed files, into the real ``HostKVCache`` base class (``pool_host/base.py``, imported
as is, with its real allocator) and runs them. Only two things are written here: the
constructor arguments a device pool would supply (geometry, no device buffers), and
``NotImplementedError`` for the device transfers (they need a GPU; the contract never calls
them).

The controller's ``attach_storage_backend`` (which picks the zero-copy or the generic page
functions) and those page functions are SGLang's code too; ``bare_controller`` gives them the
attributes a scheduler would, without its process groups and threads.
"""

from __future__ import annotations
import __future__

import ast
import importlib
import importlib.util
import logging
import sys
import threading
import time
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvflow.integrations.sglang_contract import load_contract

# packages whose __init__ imports the device runtime: entered unexecuted, their submodules run
_SHELLS = ("sglang.srt.mem_cache.pool_host",)


def _package_dir() -> Path:
    load_contract()  # enters `sglang` without its runtime when it is not loaded yet
    return Path(sys.modules["sglang"].__path__[0])


def _module(name: str) -> Any:
    for shell in _SHELLS:
        if shell not in sys.modules:
            spec = importlib.util.find_spec(shell)
            assert spec is not None
            sys.modules[shell] = importlib.util.module_from_spec(spec)
    return importlib.import_module(name)


def _classes(relpath: str, names: list[str], namespace: dict[str, Any]) -> dict[str, type]:
    """Execute the installed file's class definitions ``names`` (their source as shipped)
    in ``namespace``; return them."""
    path = _package_dir() / relpath
    tree = ast.parse(path.read_text(), filename=str(path))
    defs = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in names]
    missing = set(names) - {d.name for d in defs}
    if missing:
        raise LookupError(f"{path}: no class {sorted(missing)}")
    code = compile(
        ast.Module(body=defs, type_ignores=[]),
        str(path),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, namespace)
    return {n: namespace[n] for n in names}


def _namespace(*modules: str) -> dict[str, Any]:
    ns: dict[str, Any] = {}
    for name in modules:
        ns.update({k: v for k, v in vars(_module(name)).items() if not k.startswith("__")})
    ns.update(
        torch=torch, logging=logging, threading=threading, time=time, __name__="sglang_source"
    )
    ns.update({k: getattr(typing, k) for k in ("Any", "List", "Optional", "Sequence")})
    ns["logger"] = logging.getLogger("sglang.srt.mem_cache.pool_host")
    utils = _module("sglang.srt.utils")  # the platform flags the pool modules compute
    for flag in ("cuda", "hip", "npu", "xpu", "mps"):
        ns[f"_is_{flag}"] = getattr(utils, f"is_{flag}")()
    return ns


_POOL_MODULES = (
    "sglang.srt.mem_cache.pool_host.base",
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.pool_host.page_unified",
    "sglang.srt.mem_cache.pool_host.hisparse",
)
_POOLS: dict[str, type] = {}


def _no_device(self: Any, *args: Any, **kwargs: Any) -> None:
    raise NotImplementedError("device transfers need SGLang's device pool (a GPU)")


def _pool_class(kind: str) -> type:
    """SGLang's MHATokenToKVPoolHost / MLATokenToKVPoolHost methods on the real base class,
    with a constructor taking geometry instead of device buffer infos."""
    if kind in _POOLS:
        return _POOLS[kind]
    ns = _namespace(*_POOL_MODULES)
    base = ns["HostKVCache"]
    if kind == "mha":
        real = _classes("srt/mem_cache/pool_host/mha.py", ["MHATokenToKVPoolHost"], ns)[
            "MHATokenToKVPoolHost"
        ]
    else:
        real = _classes("srt/mem_cache/pool_host/mla.py", ["MLATokenToKVPoolHost"], ns)[
            "MLATokenToKVPoolHost"
        ]
    body = {
        k: v
        for k, v in vars(real).items()
        if not k.startswith("__") and k not in ("_initialize_transfer_views",)
    }
    body.update(
        __init__=_init_mha if kind == "mha" else _init_mla,
        load_to_device_per_layer=_no_device,
        backup_from_device_all_layer=_no_device,
        __module__=real.__module__,
        __qualname__=real.__qualname__,
    )
    cls = type(real.__name__, (base,), body)
    _POOLS[kind] = cls
    return cls


def _base_init(
    self: Any, layout: str, pages: int, page_size: int, dtype: torch.dtype, dcp_size: int = 1
) -> None:
    base = type(self).__mro__[1]
    budget = _module("sglang.srt.mem_cache.pool_host.base").host_memory_budget_scope
    with budget(1 << 40):  # SGLang keeps 10 GB of the machine free; the test pools are KBs
        base.__init__(
            self,
            dtype=dtype,
            device_capacity_tokens=page_size,  # SGLang warns when the host pool is smaller
            size_per_token=self.get_size_per_token(),
            start_layer=0,
            end_layer=self.layer_num - 1,
            host_to_device_ratio=1.0,
            host_size=0,
            page_size=page_size,
            layout=layout,
            pin_memory=False,
            device="cpu",
            host_token_capacity=pages * page_size // dcp_size,
            dcp_size=dcp_size,
        )


def _init_mha(
    self: Any,
    layout: str,
    pages: int,
    page_size: int,
    layer_num: int,
    head_num: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    # the attributes MHATokenToKVPoolHost.__init__ takes from its device buffer info
    self.dtype, self.head_num, self.head_dim, self.v_head_dim = dtype, head_num, head_dim, head_dim
    self.layer_num = self.target_layer_num = layer_num
    self.head_group_num = 1
    self._transfer_device = torch.device("cpu")
    _base_init(self, layout, pages, page_size, dtype)


def _init_mla(
    self: Any,
    layout: str,
    pages: int,
    page_size: int,
    layer_num: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    dcp_size: int = 1,
) -> None:
    # the attributes MLATokenToKVPoolHost.__init__ takes from its MLA buffer info
    self.dtype, self.kv_lora_rank, self.qk_rope_head_dim = dtype, kv_lora_rank, qk_rope_head_dim
    self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
    self.layer_num = self.target_layer_num = layer_num
    self._size_per_token = self.kv_cache_dim * dtype.itemsize * layer_num
    self._native_buffers = None
    self._transfer_device = torch.device("cpu")
    _base_init(self, layout, pages, page_size, dtype, dcp_size)


def host_pool(kind: str, layout: str, pages: int = 16, page_size: int = 4, **geometry: int) -> Any:
    """A real SGLang host pool (see the module doc): kind "mha" (by default 3 layers, 2 heads
    of 8: ``layer_num``, ``head_num``, ``head_dim``) or "mla" (3 layers, kv_lora_rank 16 +
    rope 8: ``layer_num``, ``kv_lora_rank``, ``qk_rope_head_dim``); bfloat16."""
    cls = _pool_class(kind)
    if kind == "mha":
        dims = {"layer_num": 3, "head_num": 2, "head_dim": 8, **geometry}
    else:
        dims = {"layer_num": 3, "kv_lora_rank": 16, "qk_rope_head_dim": 8, **geometry}
    return cls(layout, pages, page_size, **dims)


# ----------------------------------------------------------------- the cache controller

_CONTROLLER: dict[str, type] = {}


def controller_class() -> type:
    """SGLang's HiCacheController and PrefetchOperation, from the installed
    ``srt/managers/cache_controller.py``."""
    if not _CONTROLLER:
        ns = _namespace("sglang.srt.mem_cache.hicache_storage")
        ns["logger"] = logging.getLogger("sglang.srt.managers.cache_controller")
        ns["get_parallel"] = lambda: SimpleNamespace(attn_dcp_size=1)  # one rank, no DCP
        _CONTROLLER.update(
            _classes(
                "srt/managers/cache_controller.py",
                ["StorageOperation", "PrefetchOperation", "HiCacheController"],
                ns,
            )
        )
    return _CONTROLLER["HiCacheController"]


def prefetch_operation(request_id: str = "r0") -> Any:
    controller_class()
    return _CONTROLLER["PrefetchOperation"](request_id, [])


def bare_controller(pool: Any, storage_config: Any) -> Any:
    """A HiCacheController (SGLang's class) as a scheduler holds it, with storage not yet
    attached: its ``attach_storage_backend`` runs as is, except that the prefetch/backup
    threads and the process groups (a scheduler's) are not started. ``storage_config(
    model_name, extra_config)`` builds the HiCacheStorageConfig in place of SGLang's
    ``_generate_storage_config`` (which reads the process groups)."""
    cls = controller_class()
    ctl = cls.__new__(cls)
    ctl.enable_storage = False
    ctl.mem_pool_host = ctl.storage_host_pool = pool
    ctl.page_size = pool.page_size
    ctl.host_memory_mode = "default"
    ctl.storage_stop_event = threading.Event()
    ctl.storage_backend = ctl.storage_backend_type = None
    ctl.prefetch_hits_sync_groups, ctl.prefetch_completion_sync_groups = [], []
    ctl._generate_storage_config = storage_config
    ctl._create_sync_groups = list
    ctl._destroy_sync_groups = lambda groups: None
    ctl._start_storage_threads = lambda: None
    ctl._stop_storage_threads = lambda: None
    return ctl


__all__ = ["bare_controller", "controller_class", "host_pool", "prefetch_operation"]
