"""Authentication's cost, with and without the cluster secret in the same run:

- transfer: 1 MiB remote READs (tcp, loopback, no shm) from a server engine into a client
  engine, ``--reads`` per batch, alternating a keyed and an open pair of engines ``--repeats``
  times; median GB/s of each. Connections are pooled, so the handshake is paid once per
  connection; ``handshake_ms`` is the median cost of a fresh connection's handshake.
- TTFT: a real cluster (1 metadata replica, 1 prefill, 1 decode node, 1 router) started
  twice, with and without its secret (``LocalCluster(secure=...)``); ``--requests`` seeded
  prompts, 1 output token each; p50 of the client-side time to the first token.

Prints one summary line; ``--json PATH`` writes every number.

    .venv/bin/python -m kvflow.tools.bench.auth [--repeats 5] [--requests 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from kvflow.transfer.handshake import client_handshake

MIB = 1 << 20
KEY = bytes(range(32))


def _transfer_once(secret: bytes | None, reads: int, seed: int) -> float:
    config = TransferConfig(secret=secret, prefer_shm=False)
    with TransferEngine(config) as server, TransferEngine(config) as client:
        data = np.random.default_rng(seed).integers(0, 255, reads * MIB, dtype=np.uint8)
        server.register_memory("kv", data)
        server.start_server("127.0.0.1", 0)
        dest = np.zeros(reads * MIB, dtype=np.uint8)
        client.register_memory("dest", dest)
        target = client.open_segment(server.peer_address, "kv")
        requests = [
            TransferRequest(OpCode.READ, "dest", i * MIB, target, i * MIB, MIB)
            for i in range(reads)
        ]
        client.transfer(requests[:4], timeout=30)  # warm the connections
        started = time.perf_counter()
        statuses = client.transfer(requests, timeout=60)
        elapsed = time.perf_counter() - started
        if any(s.state.name != "COMPLETED" for s in statuses) or not np.array_equal(dest, data):
            raise RuntimeError("transfer benchmark: a read failed or returned wrong bytes")
        return reads * MIB / elapsed / 1e9


def _handshake_ms(repeats: int) -> float:
    with TransferEngine(TransferConfig(secret=KEY, prefer_shm=False)) as server:
        server.register_memory("kv", bytearray(4096))
        host, port = server.start_server("127.0.0.1", 0)
        times = []
        for _ in range(repeats):
            with socket.create_connection((host, port), timeout=5) as sock:
                started = time.perf_counter()
                client_handshake(sock, KEY)
                times.append((time.perf_counter() - started) * 1000.0)
        return statistics.median(times)


def bench_transfer(repeats: int, reads: int, seed: int) -> dict[str, Any]:
    runs: dict[str, list[float]] = {"secret": [], "open": []}
    for r in range(repeats + 1):
        for name, secret in (("secret", KEY), ("open", None)):
            gbps = _transfer_once(secret, reads, seed + r)
            if r:  # the first round is a warm-up
                runs[name].append(gbps)
    return {
        "runs_gbps": runs,
        "secret_gbps": statistics.median(runs["secret"]),
        "open_gbps": statistics.median(runs["open"]),
        "handshake_ms": _handshake_ms(20),
    }


def _ttft_p50(secure: bool, requests: int, seed: int, model: Path, data: Path) -> float:
    from kvflow.stages.api import pb2
    from kvflow.stages.api.client import InferenceClient
    from kvflow.tools.supervise import LocalCluster

    rng = random.Random(seed)
    cluster = LocalCluster(
        data,
        meta=1,
        prefill=1,
        decode=1,
        model=model,
        secure=secure,
        extra=("--block-size", "16", "--num-pages", "256", "--dram-mb", "64"),
    )
    try:
        cluster.start(timeout_s=120)
        ttfts = []
        with InferenceClient(cluster.addresses) as client:
            for _ in range(requests + 3):
                req = pb2.GenerateRequest(max_tokens=1)
                req.token_ids.ids.extend(rng.randrange(5, 200) for _ in range(96))
                started = time.perf_counter()
                next(iter(client.generate(req, timeout=60)))
                ttfts.append((time.perf_counter() - started) * 1000.0)
        return statistics.median(ttfts[3:])  # three warm-up requests dropped
    finally:
        cluster.stop()


def bench_ttft(requests: int, seed: int) -> dict[str, Any]:
    from kvflow.stages.engine import write_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        write_demo_model(model, preset="tiny", seed=seed)
        out = {}
        for name, secure in (("secret", True), ("open", False)):
            out[f"{name}_ttft_p50_ms"] = _ttft_p50(secure, requests, seed, model, Path(tmp) / name)
        return out


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reads", type=int, default=64, help="1 MiB reads per batch")
    parser.add_argument("--requests", type=int, default=30, help="TTFT requests per cluster")
    parser.add_argument("--no-ttft", action="store_true", help="transfer only (no clusters)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    return parser


def run(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"transfer": bench_transfer(args.repeats, args.reads, args.seed)}
    t = report["transfer"]
    line = (
        f"auth cost: transfer 1 MiB reads {t['secret_gbps']:.2f} GB/s with the secret vs "
        f"{t['open_gbps']:.2f} open ({t['secret_gbps'] / t['open_gbps'] - 1:+.1%}), "
        f"handshake {t['handshake_ms']:.2f} ms"
    )
    if not args.no_ttft:
        report["ttft"] = tt = bench_ttft(args.requests, args.seed)
        line += (
            f"; TTFT p50 {tt['secret_ttft_p50_ms']:.1f} ms with vs "
            f"{tt['open_ttft_p50_ms']:.1f} ms open "
            f"({tt['secret_ttft_p50_ms'] / tt['open_ttft_p50_ms'] - 1:+.1%})"
        )
    print(line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
