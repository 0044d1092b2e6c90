"""Warm-up benchmark on an embedded server (the small demo model by default).

1. Throughput: a warm-up job over N seeded prompts (tokens of prefill put into the cache per
   second) against plain requests of the same prompts (max_tokens=1) in another tenant.
2. Priority: a steady stream of online requests (one every ``--interval`` s, each a fresh
   prompt) alone, then with a warm-up job running over a large corpus; TTFT p50/p99 of both
   and the p50 ratio (target: within 1.2x).

Seeded; prints one summary line; ``--json PATH`` writes every number.
Run: ``python -m kvflow.tools.bench.warmup [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvflow.stages.api.warmup import warmup_pb2, warmup_pb2_grpc
from kvflow.stages.engine import write_demo_model
from kvflow.stages.serve.config import ServeConfig
from kvflow.stages.serve.warmup import WarmupBackgroundServer


def _prompts(n: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(tokens)] for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


class Bench:
    def __init__(self, server: WarmupBackgroundServer) -> None:
        self.server = server
        self.stub = warmup_pb2_grpc.WarmupStub(server.channel)
        self.vocab = server.cluster.tokenizer.vocab_size

    def job(self, prompts: list[list[int]], tenant: str, segment_blocks: int) -> str:
        # The corpus is a Mooncake-format trace: one hash id per block, materialised as
        # deterministic token blocks (no tokenizer in the measurement).
        body = "\n".join(json.dumps({"hash_ids": p}) for p in prompts).encode()
        req = warmup_pb2.SubmitRequest(
            files=[warmup_pb2.CorpusFile(name="bench.jsonl", content=body)],
            options=warmup_pb2.JobOptions(tenant=tenant, segment_blocks=segment_blocks),
        )
        return str(self.stub.Submit(req, timeout=60).job.job_id)

    def wait(self, job_id: str) -> Any:
        while True:
            s = self.stub.Status(warmup_pb2.JobRequest(job_id=job_id), timeout=10)
            if s.state in ("done", "cancelled", "failed"):
                return s
            time.sleep(0.02)

    def ttft(self, tokens: list[int], tenant: str) -> float:
        msgs = self.server.generate(tokens, max_tokens=1, tenant=tenant)
        return float(msgs[-1].usage.ttft_ms)


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvflow-bench-warmup-"))
    model = Path(args.model) if args.model else root / "model"
    if not args.model:
        write_demo_model(model, preset="small", seed=args.seed)
    config = ServeConfig(
        model_dir=model,
        data_dir=root / "data",
        block_size=args.block_size,
        num_pages=512,
        staging_pages=256,
        dram_capacity_bytes=1 << 30,
        ssd_capacity_bytes=1 << 30,
        prefill_chunk=args.block_size * args.segment_blocks,
        seed=args.seed,
    )
    server = WarmupBackgroundServer(config)
    try:
        b = Bench(server)
        bs = args.block_size
        blocks = args.prompt_tokens // bs
        # hash ids: distinct per prompt so nothing is shared between them
        corpus = [[i * 1000 + j for j in range(blocks)] for i in range(args.items)]
        b.ttft([1] * bs, "warm-engine")  # warm the engine's kernels once
        t0 = time.perf_counter()
        status = b.wait(b.job(corpus, "job", args.segment_blocks))
        job_s = time.perf_counter() - t0
        from kvflow.stages.warmup.materialize import trace_block_tokens

        plain = [[t for h in p for t in trace_block_tokens(h, bs, b.vocab)] for p in corpus]
        t0 = time.perf_counter()
        for p in plain:
            b.ttft([*p, 17], "plain")  # one more token: every full block is computed
        plain_s = time.perf_counter() - t0
        tokens = status.tokens_prefilled
        online = _prompts(args.online, args.online_tokens, b.vocab, args.seed)
        alone = _stream(b, online[: args.online // 2], "alone", args.interval)
        big = [[50_000_000 + i * 1000 + j for j in range(blocks)] for i in range(args.bg_items)]
        job = b.job(big, "background", args.segment_blocks)
        with_job = _stream(b, online[args.online // 2 :], "with-job", args.interval)
        bg = b.stub.Status(warmup_pb2.JobRequest(job_id=job), timeout=10)
        b.stub.Cancel(warmup_pb2.JobRequest(job_id=job), timeout=10)
    finally:
        server.close()
    return {
        "model": "small demo" if not args.model else str(args.model),
        "items": args.items,
        "prompt_tokens": blocks * bs,
        "block_size": bs,
        "segment_blocks": args.segment_blocks,
        "warmup_tokens": tokens,
        "warmup_s": job_s,
        "warmup_tok_s": tokens / job_s,
        "plain_tokens": len(plain) * blocks * bs,
        "plain_s": plain_s,
        "plain_tok_s": len(plain) * blocks * bs / plain_s,
        "ttft_alone_p50_ms": statistics.median(alone),
        "ttft_alone_p99_ms": _pct(alone, 0.99),
        "ttft_job_p50_ms": statistics.median(with_job),
        "ttft_job_p99_ms": _pct(with_job, 0.99),
        "p50_ratio": statistics.median(with_job) / statistics.median(alone),
        "bg_items_done_meanwhile": bg.items_finished,
        "online_requests": len(alone) + len(with_job),
    }


def _stream(b: Bench, prompts: list[list[int]], tenant: str, interval: float) -> list[float]:
    """Send each prompt ``interval`` s after the previous one started (open loop)."""
    out: list[float] = []
    threads = []
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        delay = start + i * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=lambda p=p: out.append(b.ttft(p, tenant)))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model directory (default: a seeded small demo model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="fewer items and requests")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--segment-blocks", type=int, default=2)
    p.add_argument("--items", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--bg-items", type=int, default=200)
    p.add_argument("--online", type=int, default=40, help="online requests (half with a job)")
    p.add_argument("--online-tokens", type=int, default=96)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between online requests")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    if args.quick:
        args.items, args.online, args.prompt_tokens = 4, 16, 256
    r = run(args)
    print(
        f"warmup: {r['warmup_tok_s']:.0f} tok/s into the cache vs plain requests "
        f"{r['plain_tok_s']:.0f} tok/s; online TTFT p50 {r['ttft_alone_p50_ms']:.0f} ms alone, "
        f"{r['ttft_job_p50_ms']:.0f} ms with a job ({r['p50_ratio']:.2f}x), p99 "
        f"{r['ttft_alone_p99_ms']:.0f}/{r['ttft_job_p99_ms']:.0f} ms; "
        f"{r['bg_items_done_meanwhile']} background items done meanwhile"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
