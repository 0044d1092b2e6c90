"""HTTP front benchmark: the same requests through the gRPC API and through HTTP streaming
(OpenAI /v1/completions with ``stream: true``), one run, one server: time to first token and
time per output token, p50 and p99, at 1 and 16 concurrent clients.

The clients are threads (a blocking gRPC stub over one channel; http.client reading SSE over
one keep-alive connection per client thread) of a separate client process by default
(``--clients process``), or of this process (``--clients thread``: they then share the GIL
with the server's event loop, and the HTTP client's per-event Python work — reading a line,
``json.loads`` — slows the server it measures); the server is a BackgroundServer (its own
event-loop thread) with the HTTP front on. The cache is flushed before each pass, so both
APIs see the same cold prompts.

Seeded; prints one summary line; ``--json PATH`` writes every number.

    python -m kvflow.tools.bench.http                    # tiny demo model
    python -m kvflow.tools.bench.http --preset small     # the 155M-parameter demo model
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import multiprocessing
import os
import platform
import random
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import torch

from kvflow.stages.api import pb2, pb2_grpc
from kvflow.stages.engine import write_demo_model
from kvflow.stages.serve.background import BackgroundServer
from kvflow.stages.serve.config import HttpConfig, ServeConfig

Timing = tuple[float, list[float]]  # (start, arrival time of each token)
_local = threading.local()


def grpc_request(stub: Any, tokens: list[int], max_tokens: int) -> Timing:
    req = pb2.GenerateRequest(max_tokens=max_tokens)
    req.sampling.ignore_eos = True
    req.token_ids.ids.extend(tokens)
    start, arrivals = time.perf_counter(), []
    for msg in stub.Generate(req, timeout=600):
        now = time.perf_counter()
        arrivals.extend(now for _ in msg.token_ids)
    return start, arrivals


def http_request(port: int, model: str, tokens: list[int], max_tokens: int) -> Timing:
    body = json.dumps(
        {
            "model": model,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    conn = getattr(_local, "conn", None)
    if conn is None:  # one keep-alive connection per client thread, as SDKs pool them
        conn = _local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start, arrivals = time.perf_counter(), []
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    for line in resp:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        choices = json.loads(line[6:])["choices"]
        if choices and choices[0]["finish_reason"] is None:  # one event per token here
            arrivals.append(time.perf_counter())
    return start, arrivals


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summarize(timings: list[Timing]) -> dict[str, float]:
    ttft = [(a[0] - s) * 1000 for s, a in timings]
    tpot = [(a[-1] - a[0]) / (len(a) - 1) * 1000 for _, a in timings if len(a) > 1]
    return {
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p99_ms": pct(tpot, 99),
        "requests": len(timings),
    }


def run_pass(
    fn: Callable[[list[int]], Timing], prompts: list[list[int]], clients: int
) -> list[Timing]:
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(fn, prompts))


def client_pass(
    api: str, grpc_address: str, http_port: int, model: str, job: tuple[list[list[int]], int, int]
) -> list[Timing]:
    """One pass run by client threads of the calling process (the client process's entry)."""
    prompts, clients, max_tokens = job
    if api == "http":
        return run_pass(lambda t: http_request(http_port, model, t, max_tokens), prompts, clients)
    with grpc.insecure_channel(grpc_address) as channel:
        stub = pb2_grpc.InferenceStub(channel)
        return run_pass(lambda t: grpc_request(stub, t, max_tokens), prompts, clients)


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The benchmark's flags, on ``p`` (``kvflow bench-http``) or a parser of its own."""
    p = p or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=32, help="per API and concurrency")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clients", default="process", choices=["process", "thread"], help="where they run"
    )
    p.add_argument("--json", type=Path)
    return p


def register(subparsers: Any) -> None:
    """``kvflow bench-http`` (cli.COMMANDS)."""
    p = build_parser(subparsers.add_parser("bench-http", help="HTTP streaming vs gRPC"))
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / args.preset, preset=args.preset, seed=args.seed)
        config = ServeConfig(
            model_dir=model,
            data_dir=Path(tmp) / "data",
            block_size=16,
            num_pages=2048,
            staging_pages=2048,
            max_tokens_limit=max(64, args.max_tokens),
            storage_engine="memory",
            seed=args.seed,
        )
        server = BackgroundServer(config, http=HttpConfig(port=0))
        pool = (
            ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            if args.clients == "process"
            else None
        )
        try:
            assert server.http is not None
            port, name = server.http.port, server.cluster.model_name
            vocab = server.cluster.vocab_size
            results: dict[str, Any] = {}

            def one_pass(api: str, prompts: list[list[int]], clients: int, n: int) -> list[Timing]:
                call = partial(client_pass, api, server.address, port, name)
                if pool is None:
                    return call((prompts, clients, n))
                return pool.submit(call, (prompts, clients, n)).result()

            warm = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(4)]
            for api in ("grpc", "http"):  # warm-up both paths (allocations, first compiles)
                one_pass(api, warm, 1, 4)
            for clients in levels:
                prompts = [
                    [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
                    for _ in range(args.requests)
                ]
                for api in ("grpc", "http"):
                    server.call(server.cluster.flush_cache)
                    timings = one_pass(api, prompts, clients, args.max_tokens)
                    results[f"{api}_c{clients}"] = summarize(timings)
        finally:
            if pool is not None:
                pool.shutdown()
            server.close()
    load = os.getloadavg()
    doc = {
        "bench": "http",
        "preset": args.preset,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "seed": args.seed,
        "clients_in": args.clients,
        "results": results,
        "load_avg": load,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    parts = []
    for clients in levels:
        g, h = results[f"grpc_c{clients}"], results[f"http_c{clients}"]
        parts.append(
            f"c={clients}: ttft p50 grpc {g['ttft_p50_ms']:.1f} / http {h['ttft_p50_ms']:.1f} ms, "
            f"tpot p50 grpc {g['tpot_p50_ms']:.2f} / http {h['tpot_p50_ms']:.2f} ms"
        )
    print(
        f"bench http ({args.preset}, {args.prompt_tokens}+{args.max_tokens} tokens, "
        f"{args.requests} req, clients in a {args.clients}): "
        + "; ".join(parts)
        + f"; load avg {load[0]:.2f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
