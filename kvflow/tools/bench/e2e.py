"""End-to-end benchmark: TTFT through the real gRPC server, cold vs warm, and routing policies.

Part 1 (one prefill + one decode instance): for each prompt length N and cached fraction f,
  - cold TTFT: a prompt of N fresh tokens;
  - warm TTFT: a prompt whose first f*N tokens (whole blocks) were served before, so they come
    from the store (reuse-load) and only the suffix is computed;
  - in the same run, suffix-only: the engine alone computing just those uncached tokens with
    the prefix already in its pages (the floor warm TTFT is compared with).
Part 2 (two prefill + one decode): 8 concurrent clients sharing a long system prompt, with each
routing policy: requests/s and TTFT p50/p99.

Seeded; prints one summary line; `--json PATH` writes every number.

    python -m kvflow.tools.bench.e2e                 # small preset, 2K and 8K prompts
    python -m kvflow.tools.bench.e2e --quick         # tiny preset, seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvflow.router import policy_names
from kvflow.stages.api import pb2
from kvflow.stages.engine import Engine, EngineConfig, SamplingParams, write_demo_model
from kvflow.stages.serve.background import BackgroundServer
from kvflow.stages.serve.config import ServeConfig
from kvflow.stages.serve.embedded import ensure_model


class Server(BackgroundServer):
    def ttft(self, tokens: list[int], max_tokens: int) -> tuple[float, Any]:
        """(client-side TTFT seconds, usage) of one request."""
        req = pb2.GenerateRequest(max_tokens=max_tokens)
        req.sampling.ignore_eos = True
        req.token_ids.ids.extend(tokens)
        start = time.perf_counter()
        ttft = None
        usage = None
        for msg in self.stub.Generate(req, timeout=3600):
            if ttft is None and msg.token_ids:
                ttft = time.perf_counter() - start
            if msg.finished:
                usage = msg.usage
        assert ttft is not None and usage is not None
        return ttft, usage


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


def suffix_only_s(engine: Engine, prefix: list[int], suffix: list[int]) -> float:
    """Seconds to compute just ``suffix`` with ``prefix`` already in the engine's pages."""
    engine.add_request("src", prefix, SamplingParams(max_tokens=1), retain_pages=True)
    while engine.has_unfinished():
        engine.step()
    pages = [engine.export_page("src", b).clone() for b in range(len(prefix) // engine.block_size)]
    engine.release("src")
    engine.add_request(
        "sfx",
        prefix + suffix,
        SamplingParams(max_tokens=1),
        prefix_pages=pages,
        num_prefix_tokens=len(prefix),
    )
    start = time.perf_counter()  # the pages are in the pool now: time only the computation
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def ttft_matrix(args: argparse.Namespace, model: Path, data: Path) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    bs = args.block_size
    longest = max(args.lengths)
    pages = (longest // bs + 2) * 3
    config = ServeConfig(
        model_dir=model,
        data_dir=data / "ttft",
        dtype=args.dtype,
        block_size=bs,
        num_pages=pages,
        staging_pages=pages,
        prefill_chunk=args.prefill_chunk,
        dram_capacity_bytes=args.dram_mb << 20,
        max_tokens_limit=64,
        seed=args.seed,
    )
    server = Server(config)
    engine = Engine.open(
        model,
        EngineConfig(
            dtype=args.dtype, block_size=bs, num_pages=pages, prefill_chunk=args.prefill_chunk
        ),
    )
    rows = []
    try:
        server.ttft(_tokens(rng, 2 * bs), 1)  # warm-up
        for n in args.lengths:
            for frac in args.fractions:
                cached = int(n * frac) // bs * bs
                cold, warm, floor, hits = [], [], [], []
                for _ in range(args.repeats):
                    prefix = _tokens(rng, cached)
                    server.ttft(prefix + _tokens(rng, bs + 1), 1)  # puts the prefix blocks
                    cold.append(server.ttft(_tokens(rng, n), 1)[0])
                    suffix = _tokens(rng, n - cached)
                    ttft, usage = server.ttft(prefix + suffix, 1)
                    warm.append(ttft)
                    hits.append(usage.cached_tokens)
                    floor.append(suffix_only_s(engine, prefix, suffix))
                row = {
                    "prompt_tokens": n,
                    "cached_fraction": frac,
                    "cached_tokens": min(hits),
                    "cold_ttft_s": statistics.median(cold),
                    "warm_ttft_s": statistics.median(warm),
                    "suffix_only_s": statistics.median(floor),
                }
                row["warm_over_suffix"] = row["warm_ttft_s"] / row["suffix_only_s"]
                row["warm_over_cold"] = row["warm_ttft_s"] / row["cold_ttft_s"]
                rows.append(row)
                logging.info("ttft %s", row)
    finally:
        server.close()
    return rows


def policy_run(args: argparse.Namespace, model: Path, data: Path, policy: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    bs = args.block_size
    system = _tokens(rng, args.system_tokens)
    per_page = args.system_tokens // bs + args.user_tokens // bs + 4
    config = ServeConfig(
        model_dir=model,
        data_dir=data / policy,
        dtype=args.dtype,
        block_size=bs,
        num_prefill=2,
        num_decode=1,
        policy=policy,
        num_pages=per_page * args.clients * 2,
        staging_pages=per_page * args.clients * 2,
        prefill_chunk=args.prefill_chunk,
        dram_capacity_bytes=args.dram_mb << 20,
        max_tokens_limit=64,
        seed=args.seed,
    )
    server = Server(config)
    prompts = [
        [system + _tokens(rng, args.user_tokens) for _ in range(args.requests_per_client)]
        for _ in range(args.clients)
    ]
    ttfts: list[float] = []
    cached: list[int] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for prompt in prompts[i]:
            ttft, usage = server.ttft(prompt, args.output_tokens)
            with lock:
                ttfts.append(ttft)
                cached.append(usage.cached_tokens)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(client, range(args.clients)))
        elapsed = time.perf_counter() - start
    finally:
        server.close()
    ttfts.sort()
    n = len(ttfts)
    return {
        "policy": policy,
        "requests": n,
        "elapsed_s": elapsed,
        "requests_per_s": n / elapsed,
        "ttft_p50_s": ttfts[n // 2],
        "ttft_p99_s": ttfts[min(n - 1, int(n * 0.99))],
        "ttft_mean_s": statistics.fmean(ttfts),
        "cached_token_ratio": sum(cached) / (n * (args.system_tokens + args.user_tokens)),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model dir (default: the small demo model)")
    p.add_argument("--quick", action="store_true", help="tiny preset and small sizes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--fractions", default="0.5,0.95")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--policies", default=",".join(policy_names()))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--dram-mb", type=int, default=4096)
    p.add_argument("--skip-policies", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.fractions = [float(x) for x in args.fractions.split(",")]
    args.policies = [x for x in args.policies.split(",") if x]
    if args.quick:
        args.lengths, args.block_size, args.prefill_chunk = [256], 16, 64
        args.system_tokens, args.user_tokens, args.output_tokens = 128, 16, 4
        args.clients, args.requests_per_client, args.dram_mb = 4, 2, 256
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        if args.model is not None:
            model = args.model
        elif args.quick:
            model = data / "tiny"
            write_demo_model(model, preset="tiny", seed=args.seed)
        else:
            model = ensure_model(ServeConfig(data_dir=Path("data"), seed=args.seed))
        rows = ttft_matrix(args, model, data)
        policies = (
            [] if args.skip_policies else [policy_run(args, model, data, p) for p in args.policies]
        )
    result = {
        "machine": {
            "cpus": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ttft": rows,
        "policies": policies,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    top = max(rows, key=lambda r: (r["prompt_tokens"], r["cached_fraction"]))
    best = min(policies, key=lambda r: r["ttft_p50_s"]) if policies else None
    print(
        f"bench_e2e N={top['prompt_tokens']} cached={top['cached_fraction']:.0%}: "
        f"cold {top['cold_ttft_s'] * 1000:.0f} ms, warm {top['warm_ttft_s'] * 1000:.0f} ms "
        f"({top['warm_over_cold']:.1%} of cold, {top['warm_over_suffix']:.2f}x suffix-only "
        f"{top['suffix_only_s'] * 1000:.0f} ms)"
        + (
            f"; best policy {best['policy']} p50 {best['ttft_p50_s'] * 1000:.0f} ms "
            f"{best['requests_per_s']:.2f} req/s"
            if best
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
