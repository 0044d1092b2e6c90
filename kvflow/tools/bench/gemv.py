"""Decode matrix-vector microbenchmark: the float32 kernel (cpu_gemv.c) against the kernel it
replaced (one horizontal reduction per output and row, kept here only), oneDNN's inner
product and a plain read of the same weights.

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
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvflow.stages.engine import cpu_kernels
from kvflow.stages.engine.cpu_gemv import gemv_kernel
from kvflow.tools.bench._cli import entry_points
from kvflow.tools.bench._meta import run_meta

# The kernel of tree e3555cf (one `dot` with its own reduction per output and row), kept
# for this A/B only.
OLD_SOURCE = r"""
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
static inline float dot(const float *x, const float *w, long K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    long k = 0;
    for (; k + 64 <= K; k += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 32), _mm512_loadu_ps(w + k + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 48), _mm512_loadu_ps(w + k + 48), a3);
    }
    for (; k + 16 <= K; k += 16)
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
    if (k < K) {
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#else
static inline float dot(const float *x, const float *w, long K) {
    float a = 0.0f;
#pragma omp simd reduction(+ : a)
    for (long k = 0; k < K; k++) a += x[k] * w[k];
    return a;
}
#endif
static void rows(const float *x, const float *w, const float *b, float *y, long M, long N,
                 long K, long lo, long hi) {
    for (long o = lo; o < hi; o++) {
        const float *wr = w + o * K;
        for (long m = 0; m < M; m++) y[m * N + o] = dot(x + m * K, wr, K) + (b ? b[o] : 0.0f);
    }
}
void old_gemv(const float *x, const float *w, const float *b, float *y, long M, long N,
              long K, long threads) {
    if (threads <= 1 || N < 64) { rows(x, w, b, y, M, N, K, 0, N); return; }
#pragma omp parallel num_threads(threads)
    {
        long t = omp_get_thread_num(), n = omp_get_num_threads();
        long step = (N + n - 1) / n;
        long lo = t * step, hi = lo + step < N ? lo + step : N;
        if (lo < hi) rows(x, w, b, y, M, N, K, lo, hi);
    }
}
"""

LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K): qkv, o, gate_up, down
LM_HEAD = (49152, 576)
VARIANTS = ("new", "old", "onednn", "read")

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _old_kernel(workdir: Path) -> Linear:
    src, lib = workdir / "old_gemv.c", workdir / "old_gemv.so"
    src.write_text(OLD_SOURCE)
    cc = cpu_kernels._compiler() or "cc"
    subprocess.run([cc, *cpu_kernels.FLAGS, "-o", str(lib), str(src)], check=True, timeout=120)
    fn = ctypes.CDLL(str(lib)).old_gemv
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4

    def old(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        (m, k), n = x.shape, w.shape[0]
        y = torch.empty((m, n))
        fn(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), m, n, k, torch.get_num_threads())
        return y

    return old


def _variants(workdir: Path) -> dict[str, Linear]:
    new = gemv_kernel()
    if new is None:
        raise SystemExit("gemv: the CPU kernels cannot be built here (see the log)")
    return {
        "new": lambda x, w: new(x, w, None),
        "old": _old_kernel(workdir),
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
    with tempfile.TemporaryDirectory(prefix="kvflow-gemv-") as tmp, torch.inference_mode():
        fns = _variants(Path(tmp))
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
