"""Decode attention benchmark: one decode step's attention for a batch of long rows, through
every layer, against the rate this machine reads memory at.

`--rows` requests of `--context` tokens each (their pages spread over the engine's own page
pool in a seeded random order, as a busy pool's are) take one decode step: `PagedDecode` is
built as a forward builds it and `attend` runs for each of `--layers` layers (the new K/V
written into its slot, then the attention: with `KVFLOW_ATTN=paged` the kernel over the
pages in place, cpu_attn.c; with `torch`, the gather and torch's attention). The default
model's shapes unless told (9 query heads on 3 KV heads, head dim 64, pages of 64). A decode
step reads every row's K and V once, so its speed is bytes over time; the read rate is
`torch.sum` over the whole pool, timed in the same rounds. The settings and the read run
alternate, A B R, R B A, ..., `--rounds` rounds; each takes its best round. Each setting's
outputs are compared with the first's (`max_abs_diff`: a fast wrong kernel is no result).
Seeded; one summary line; `--json PATH` writes every number.

    python -m kvflow.tools.bench.decode_attention                   # 8 rows x 2,000 tokens
    python -m kvflow.tools.bench.decode_attention --rows 1 --context 4000 --json out.json
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kvflow.stages.engine.attention import PagedDecode
from kvflow.stages.engine.cpu_attn import ENV_ATTN
from kvflow.stages.engine.pages import KVLayout, PagePool
from kvflow.tools.bench._attention import add_shape_arguments, report

READ = "read"
"""The name of the read-rate run among the settings' results."""


def kv_bytes(rows: int, context: int, layers: int, kv_heads: int, d: int) -> int:
    """Bytes of K and V that one decode step of `rows` rows of `context` keys reads."""
    return rows * context * layers * 2 * kv_heads * d * 4


def _step(
    pool: PagePool, table: torch.Tensor, positions: torch.Tensor, qkv: torch.Tensor, layers: int
) -> list[torch.Tensor]:
    """One decode step's attention through every layer (the backend built once, as a forward
    builds it): each layer's output [rows, heads * d]."""
    kvh = pool.layout.num_kv_heads
    q, k, v = qkv.split((qkv.shape[1] - 2 * kvh, kvh, kvh), dim=1)
    backend = PagedDecode(pool, table, positions, None)
    return [backend.attend(layer, q, k, v) for layer in range(layers)]


def _time_read(pool: PagePool) -> float:
    began = time.perf_counter()
    pool.tensor.sum()
    return time.perf_counter() - began


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    kvh, d, bs = args.kv_heads, args.head_dim, args.block
    per_row = -(-args.context // bs)
    n_pages = args.rows * per_row
    layout = KVLayout(num_layers=args.layers, num_kv_heads=kvh, head_dim=d, block_size=bs,
                      dtype="float32")  # fmt: skip
    pool = PagePool(n_pages + 2, layout, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(args.seed)
    pool.tensor.normal_(generator=gen)
    table = torch.randperm(n_pages + 2, generator=gen)[:n_pages].view(args.rows, per_row)
    positions = torch.full((args.rows,), args.context - 1, dtype=torch.int64)
    qkv = torch.randn(args.rows, args.heads + 2 * kvh, d, generator=gen)
    runs = [*args.attention, READ]
    best = {name: float("inf") for name in runs}
    outputs: dict[str, torch.Tensor] = {}  # each setting's last step, compared below
    saved = os.environ.get(ENV_ATTN)
    try:
        for r in range(args.rounds):
            for name in runs if r % 2 == 0 else list(reversed(runs)):
                if name == READ:
                    took = _time_read(pool)
                else:
                    os.environ[ENV_ATTN] = name
                    began = time.perf_counter()
                    out = _step(pool, table, positions, qkv, args.layers)
                    took = time.perf_counter() - began
                    outputs[name] = torch.stack(out)
                best[name] = min(best[name], took)
    finally:
        if saved is None:
            os.environ.pop(ENV_ATTN, None)
        else:
            os.environ[ENV_ATTN] = saved
    read_rate = pool.tensor.nbytes / best[READ]
    nbytes = kv_bytes(args.rows, args.context, args.layers, kvh, d)
    results: dict = {READ: {"seconds": best[READ], "bytes": pool.tensor.nbytes,
                            "gb_s": read_rate / 1e9}}  # fmt: skip
    first = outputs[args.attention[0]]
    for name in args.attention:
        rate = nbytes / best[name]
        differ = float((outputs[name] - first).abs().max())
        results[name] = {"seconds": best[name], "bytes": nbytes, "gb_s": rate / 1e9,
                         "of_read_rate": rate / read_rate,
                         "max_abs_diff": differ}  # fmt: skip
    return results


def summary(args: argparse.Namespace, results: dict) -> str:
    head = (
        f"bench_decode_attention {args.rows} rows x {args.context} tokens x {args.layers} layers"
        f" | read rate {results[READ]['gb_s']:.1f} GB/s"
    )
    parts = [
        f"{name}: {res['seconds'] * 1e3:.1f} ms {res['gb_s']:.1f} GB/s "
        f"({res['of_read_rate']:.0%} of the read rate)"
        for name, res in results.items()
        if name != READ
    ]
    return head + " | " + " | ".join(parts)


def _main(args: argparse.Namespace) -> int:
    results = run(args)
    return report(args, summary(args, results), results)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--rows", type=int, default=8, help="requests decoding together")
    p.add_argument("--context", type=int, default=2000, help="tokens each row attends to")
    return add_shape_arguments(p, rounds=8)


def main(argv: list[str] | None = None) -> int:
    p = add_arguments(argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0]))
    return _main(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
