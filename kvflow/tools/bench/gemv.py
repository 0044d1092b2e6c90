"""Decode matrix-vector microbenchmark: the float32 kernel (cpu_gemv.c) against the kernel it
replaced (one horizontal reduction per output and row: the same library's
`kvflow_gemv_blocked_from` with blocking off), oneDNN's inner product and a plain read of the
same weights.

One pass is every linear of SmolLM2-135M-Instruct (30 layers of fused q/k/v 960x576, o
576x576, fused gate/up 3072x576, down 576x1536, then the lm_head 49152x576: 538 MB of
distinct float32 weights, so each pass reads them from memory as a decode step does) at M
input rows. The variants alternate within each repeat, in a rotating order; the report is
each variant's best pass in ms, its weight-read rate and its ratio to `old`.

    python -m kvflow.tools.bench.gemv                       # M = 1,2,4,8,16, 2 threads
    python -m kvflow.tools.bench.gemv --rows 8 --repeat 3 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvflow.stages.engine import cpu_kernels
from kvflow.stages.engine.cpu_gemv import gemv_kernel
from kvflow.tools.bench._cli import entry_points
from kvflow.tools.bench._meta import run_meta

LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K): qkv, o, gate_up, down
LM_HEAD = (49152, 576)
VARIANTS = ("new", "old", "onednn", "read")

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _old_kernel() -> Linear:
    """The kernel before blocking (one dot product per output and row, as in tree e3555cf):
    `kvflow_gemv_blocked_from` of the same library with blocking from more rows than any."""
    lib = cpu_kernels.library()
    if lib is None:
        raise SystemExit("gemv: the CPU kernels cannot be built here (see the log)")
    fn = lib.kvflow_gemv_blocked_from
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 5

    def old(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        (m, k), n = x.shape, w.shape[0]
        y = torch.empty((m, n))
        fn(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), m, n, k, torch.get_num_threads(), m + 1)
        return y

    return old


def _variants() -> dict[str, Linear]:
    new = gemv_kernel()
    if new is None:
        raise SystemExit("gemv: the CPU kernels cannot be built here (see the log)")
    return {
        "new": lambda x, w: new(x, w, None),
        "old": _old_kernel(),
        "onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "read": lambda x, w: w.sum(),
    }


def _weights(seed: int, layers: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [s for _ in range(layers) for s in LAYER_SHAPES] + [LM_HEAD]
    return [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]


def _pass(fn: Linear, weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        fn(xs[w.shape[1]], w)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    weights = _weights(args.seed, args.layers)
    nbytes = sum(w.numel() * 4 for w in weights)
    gen = torch.Generator().manual_seed(args.seed + 1)
    results: list[dict[str, Any]] = []
    with torch.inference_mode():
        fns = _variants()
        names = [v for v in args.variants if v in fns]
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for w in weights}}
            times: dict[str, list[float]] = {v: [] for v in names}
            for v in names:  # warm: build, first touch
                _pass(fns[v], weights, xs)
            for r in range(args.repeat):
                for i in range(len(names)):  # a rotating order
                    v = names[(i + r) % len(names)]
                    times[v].append(_pass(fns[v], weights, xs))
            for v in names:
                best, med = min(times[v]), statistics.median(times[v])
                results.append(
                    {
                        "rows": rows,
                        "variant": v,
                        "best_ms": best * 1e3,
                        "median_ms": med * 1e3,
                        "gb_s": nbytes / best / 1e9,
                    }
                )
    base = {r["rows"]: r["best_ms"] for r in results if r["variant"] == "old"}
    print(f"{'rows':>4} {'variant':>7} {'best ms':>8} {'median':>8} {'GB/s':>6} {'old/this':>8}")
    for r in results:
        ratio = base[r["rows"]] / r["best_ms"] if r["rows"] in base else float("nan")
        r["speedup_vs_old"] = ratio
        print(
            f"{r['rows']:>4} {r['variant']:>7} {r['best_ms']:>8.2f} {r['median_ms']:>8.2f} "
            f"{r['gb_s']:>6.1f} {ratio:>8.2f}"
        )
    summary = " ".join(
        f"M{r['rows']}:{r['speedup_vs_old']:.2f}x" for r in results if r["variant"] == "new"
    )
    print(f"gemv: new kernel vs old (best pass, {nbytes / 1e6:.0f} MB of weights) {summary}")
    if args.json:
        meta = run_meta(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"}))
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def _rows(value: str) -> list[int]:
    try:
        got = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        got = []
    if not got or any(r < 1 for r in got):
        raise argparse.ArgumentTypeError(f"--rows must be positive integers, got {value!r}")
    return got


def _variant_names(value: str) -> list[str]:
    got = [v.strip() for v in value.split(",") if v.strip()]
    if not got or any(v not in VARIANTS for v in got):
        raise argparse.ArgumentTypeError(f"--variants: one or more of {VARIANTS}, got {value!r}")
    return got


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--rows", type=_rows, default=[1, 2, 4, 8, 16], help="input rows (M)")
    p.add_argument("--variants", type=_variant_names, default=list(VARIANTS))
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers' linears a pass")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write full results here")
    p.set_defaults(func=run)
    return p


register, main = entry_points("bench-gemv", __doc__ or "", add_arguments)

if __name__ == "__main__":
    raise SystemExit(main())
