"""Prefill attention benchmark: one layer's attention of a prompt's chunks, the paged prefill
kernel against torch's path, on the engine's own page pool.

A prompt of `--tokens` is cut into chunks of `--chunk` (the engine's prefill chunks); each
chunk runs `PagedPrefill.attend` for each of `--layers` layers (the K/V write into the pages,
then the attention: with `KVFLOW_ATTN=paged` the kernel over the pages in place, cpu_prefill.c;
with `torch`, the gather and torch's flash kernel in query blocks), with the default model's
shapes unless told (9 query heads on 3 KV heads, head dim 64, pages of 64). The settings run
alternating, A B B A ..., `--rounds` rounds; each chunk's time is the best over the rounds,
with the causal attention FLOP/s it implies (4 d per visible query-key pair, per query head).
Seeded; one summary line; `--json PATH` writes every number.

    python -m kvflow.tools.bench.prefill_attention                  # 2,000 tokens, 30 layers
    python -m kvflow.tools.bench.prefill_attention --tokens 512 --json out.json
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kvflow.stages.engine.attention import PagedPrefill
from kvflow.stages.engine.cpu_attn import ENV_ATTN
from kvflow.stages.engine.pages import KVLayout, PagePool
from kvflow.tools.bench._attention import add_shape_arguments, report


def chunk_flops(start: int, t: int, heads: int, d: int) -> int:
    """Causal attention FLOPs of queries [start, start + t): 4 d per visible pair a head."""
    pairs = t * start + t * (t + 1) // 2
    return 4 * d * heads * pairs


def _time_chunk(
    pool: PagePool, pages: torch.Tensor, start: int, qkv: torch.Tensor, args: argparse.Namespace
) -> float:
    """Seconds for one chunk through every layer (the backend built once, as a forward)."""
    t = qkv.shape[0]
    q, k, v = qkv.split((args.heads, args.kv_heads, args.kv_heads), dim=1)
    began = time.perf_counter()
    backend = PagedPrefill(pool, pages, start, t, None)
    for layer in range(args.layers):
        backend.attend(layer, q, k, v)
    return time.perf_counter() - began


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    heads, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block
    n_pages = -(-args.tokens // bs)
    layout = KVLayout(num_layers=args.layers, num_kv_heads=kvh, head_dim=d, block_size=bs,
                      dtype="float32")  # fmt: skip
    pool = PagePool(n_pages + 2, layout, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(args.seed)
    pool.tensor.normal_(generator=gen)
    pages = torch.randperm(n_pages + 2, generator=gen)[:n_pages]
    chunks = [(s, min(args.chunk, args.tokens - s)) for s in range(0, args.tokens, args.chunk)]
    inputs = [torch.randn(t, heads + 2 * kvh, d, generator=gen) for _, t in chunks]
    best: dict[str, list[float]] = {s: [float("inf")] * len(chunks) for s in args.attention}
    saved = os.environ.get(ENV_ATTN)
    try:
        for r in range(args.rounds):
            order = args.attention if r % 2 == 0 else list(reversed(args.attention))
            for setting in order:
                os.environ[ENV_ATTN] = setting
                for i, ((start, _), qkv) in enumerate(zip(chunks, inputs, strict=True)):
                    took = _time_chunk(pool, pages, start, qkv, args)
                    best[setting][i] = min(best[setting][i], took)
    finally:
        if saved is None:
            os.environ.pop(ENV_ATTN, None)
        else:
            os.environ[ENV_ATTN] = saved
    results = {}
    for setting, times in best.items():
        rows = [
            {"start": s, "tokens": t, "seconds": sec,
             "gflops": chunk_flops(s, t, heads, d) * args.layers / sec / 1e9}
            for (s, t), sec in zip(chunks, times, strict=True)
        ]  # fmt: skip
        total = sum(times)
        flops = sum(chunk_flops(s, t, heads, d) for s, t in chunks) * args.layers
        results[setting] = {"chunks": rows, "seconds": total, "gflops": flops / total / 1e9}
    return results


def summary(args: argparse.Namespace, results: dict) -> str:
    parts = []
    for setting, res in results.items():
        chunks = " ".join(f"@{c['start']}={c['seconds'] * 1e3:.1f}ms" for c in res["chunks"])
        parts.append(
            f"{setting}: {res['seconds'] * 1e3:.1f} ms {res['gflops']:.0f} GFLOP/s ({chunks})"
        )
    head = f"bench_prefill_attention {args.tokens} tokens x {args.layers} layers"
    return head + " | " + " | ".join(parts)


def _main(args: argparse.Namespace) -> int:
    results = run(args)
    return report(args, summary(args, results), results)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--tokens", type=int, default=2000, help="prompt length")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    return add_shape_arguments(p, rounds=4)


def main(argv: list[str] | None = None) -> int:
    p = add_arguments(argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0]))
    return _main(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
