"""`bench_sglang_hicache`: SGLang's zero-copy HiCache page path against its generic one, on
kvflow's backend, in one run.

SGLang's own cache-controller functions move the pages (``_page_set_zero_copy`` /
``_generic_page_set`` for a backup, ``_page_get_zero_copy`` / ``_generic_page_get`` for a
prefetch) between SGLang's own host pool code (see sglang_source.py) and a kvflow backend on
an embedded in-memory store, per layout (MHA ``page_first`` and ``layer_first`` by default).
Each round backs up ``--pages`` seeded pages under fresh keys and prefetches them into other
slots, once per path, back to back (same background load), checks every page bit for bit and
clears the store; the first round is dropped; reported are the medians of ``--repeat`` rounds
(GB/s of page bytes) and of the per-round zero-copy/generic ratios. Prints one summary line;
``--json PATH`` writes everything, with the load average before and after.

    .venv/bin/python -m kvflow.tools.bench.sglang_hicache --repeat 7 --json bench_hicache.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvflow.integrations.sglang_contract import load_contract
from kvflow.tools.bench.sglang_source import bare_controller, host_pool, prefetch_operation

BACKEND = {
    "backend_name": "kvflow",
    "module_path": "kvflow.integrations.sglang_hicache",
    "class_name": "KvflowHiCacheStorage",
    "interface_v1": 1,
    "kvflow_node_id": "bench",
    "kvflow_engine": "memory",
}
PATHS = ("zero_copy", "generic")


def _controller(layout: str, args: argparse.Namespace) -> tuple[Any, Any]:
    contract = load_contract()
    pool = host_pool(
        "mha",
        layout,
        pages=2 * args.pages + 1,
        page_size=args.page_size,
        layer_num=args.layers,
        head_num=args.heads,
        head_dim=args.head_dim,
    )
    page_bytes = pool.get_size_per_token() * args.page_size
    extra = {**BACKEND, "kvflow_dram_bytes": 4 * args.pages * page_bytes}

    def config(model_name: str | None, extra_config: dict[str, Any] | None) -> Any:
        return contract.HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=layout == "page_first",
            model_name=model_name,
            extra_config=extra_config,
        )

    ctl = bare_controller(pool, config)
    ctl.attach_storage_backend("dynamic", model_name="bench", storage_backend_extra_config=extra)
    return pool, ctl


def _slots(pages: range, page_size: int) -> torch.Tensor:
    return torch.cat(
        [torch.arange(p * page_size, (p + 1) * page_size, dtype=torch.int64) for p in pages]
    )


def _round(pool: Any, ctl: Any, path: str, tag: str, args: argparse.Namespace) -> dict[str, float]:
    ps, n = args.page_size, args.pages
    src, dst = _slots(range(n), ps), _slots(range(n, 2 * n), ps)
    keys = [f"{tag}-{path}-{i}" for i in range(n)]
    start = time.perf_counter()
    if path == "zero_copy":
        ok = ctl._page_set_zero_copy(keys, src)
    else:
        ok = ctl._generic_page_set(keys, src)
    backup = time.perf_counter() - start
    zero = pool.get_dummy_flat_data_page()
    for i in range(n):  # the destination pages start empty
        pool.set_from_flat_data_page((n + i) * ps, zero)
    start = time.perf_counter()
    if path == "zero_copy":
        got = ctl._page_get_zero_copy(prefetch_operation(), keys, dst)
    else:
        got = ctl._generic_page_get(prefetch_operation(), keys, dst)
    prefetch = time.perf_counter() - start
    if not ok or got != n:
        raise RuntimeError(f"{path}: backup {ok}, prefetched {got} of {n} pages")
    for i in range(n):
        if not torch.equal(pool.get_data_page(i * ps), pool.get_data_page((n + i) * ps)):
            raise RuntimeError(f"{path}: page {i} differs after the round trip")
    ctl.storage_backend.clear()
    page_bytes = pool.get_size_per_token() * ps
    return {
        "backup_gbps": n * page_bytes / backup / 1e9,
        "prefetch_gbps": n * page_bytes / prefetch / 1e9,
    }


def _layout(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    pool, ctl = _controller(layout, args)
    try:
        gen = torch.Generator().manual_seed(args.seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.dtype))
        rounds: list[dict[str, dict[str, float]]] = []
        for r in range(args.repeat + 1):
            rounds.append({p: _round(pool, ctl, p, f"r{r}", args) for p in PATHS})
        rounds = rounds[1:]
        out: dict[str, Any] = {"layout": layout, "rounds": rounds}
        for op in ("backup", "prefetch"):
            for p in PATHS:
                out[f"{op}_{p}_gbps"] = statistics.median(x[p][f"{op}_gbps"] for x in rounds)
            out[f"{op}_ratio"] = statistics.median(
                x["zero_copy"][f"{op}_gbps"] / x["generic"][f"{op}_gbps"] for x in rounds
            )
        return out
    finally:
        ctl.storage_backend.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_sglang_hicache", description=__doc__)
    parser.add_argument("--layouts", default="page_first,layer_first")
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    results = [_layout(layout, args) for layout in args.layouts.split(",")]
    load_after = os.getloadavg()
    page_mib = 2 * args.layers * args.page_size * args.heads * args.head_dim * 2 / (1 << 20)
    parts = [
        f"{r['layout']}: backup {r['backup_zero_copy_gbps']:.2f} vs "
        f"{r['backup_generic_gbps']:.2f} GB/s ({r['backup_ratio']:.2f}x), prefetch "
        f"{r['prefetch_zero_copy_gbps']:.2f} vs {r['prefetch_generic_gbps']:.2f} GB/s "
        f"({r['prefetch_ratio']:.2f}x)"
        for r in results
    ]
    print(
        f"sglang hicache zero-copy vs generic, MHA bf16, {args.pages} pages x {page_mib:.2f} MiB, "
        f"median of {args.repeat}: " + "; ".join(parts) + f"; load {load_before[0]:.2f}"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "load_before": load_before,
                    "load_after": load_after,
                    "results": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
