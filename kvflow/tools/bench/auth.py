"""Authentication's cost, every variant in the same run and interleaved, so the box's noise
falls on all of them alike:

- TTFT: three real clusters (1 metadata replica, 1 prefill, 1 decode node, 1 router each)
  running *at the same time*: ``open`` (no secret), ``secret`` (the cluster secret on every
  channel) and ``tls`` (the secret under TLS on every gRPC port, ``LocalCluster(tls=True)``).
  Each round sends one seeded prompt (96 tokens, 1 output token; a fresh prompt per round,
  the same prompt to every cluster) to each cluster in turn, the order rotating each round;
  ``--requests`` rounds after 3 warm-up rounds. Reports each cluster's p50 of the client-side
  time to the first token and the median of the paired differences (variant - open, same
  round).
- transfer (``auth_transfer``): 1 MiB remote reads with and without the handshake key,
  alternating batches; and what TLS costs on one loopback connection (``ssl``), alternating
  batches with a plain one.

Prints one summary line; ``--json PATH`` writes every number, with the load average
(``os.getloadavg()``) before and after.

    .venv/bin/python -m kvflow.tools.bench.auth [--repeats 9] [--requests 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvflow.tools.bench.auth_transfer import bench_tls_socket, bench_transfer

VARIANTS = ("open", "secret", "tls")
WARMUP_ROUNDS = 3


def _cluster(name: str, model: Path, data: Path) -> Any:
    from kvflow.tools.supervise import LocalCluster

    return LocalCluster(
        data / name,
        meta=1,
        prefill=1,
        decode=1,
        model=model,
        secure=name != "open",
        tls=name == "tls",
        extra=("--block-size", "16", "--num-pages", "256", "--dram-mb", "64"),
    )


def _ttft_ms(client: Any, ids: list[int]) -> float:
    from kvflow.stages.api import pb2

    req = pb2.GenerateRequest(max_tokens=1)
    req.token_ids.ids.extend(ids)
    started = time.perf_counter()
    next(iter(client.generate(req, timeout=60)))
    return (time.perf_counter() - started) * 1000.0


def _interleaved(clients: dict[str, Any], requests: int, seed: int) -> dict[str, list[float]]:
    """TTFTs per variant: round r sends one fresh prompt to every client, order rotated."""
    rng = random.Random(seed)
    names = list(clients)
    ttfts: dict[str, list[float]] = {name: [] for name in names}
    for r in range(requests + WARMUP_ROUNDS):
        ids = [rng.randrange(5, 200) for _ in range(96)]
        k = r % len(names)
        for name in names[k:] + names[:k]:
            ms = _ttft_ms(clients[name], ids)
            if r >= WARMUP_ROUNDS:
                ttfts[name].append(ms)
    return ttfts


def summarize_ttft(ttfts: dict[str, list[float]]) -> dict[str, Any]:
    """p50 per variant; per variant but ``open``, the median paired difference (ms) and it
    relative to open's p50."""
    open_p50 = statistics.median(ttfts["open"])
    out: dict[str, Any] = {f"{name}_ttft_p50_ms": statistics.median(v) for name, v in ttfts.items()}
    for name, values in ttfts.items():
        if name == "open":
            continue
        diffs = [a - b for a, b in zip(values, ttfts["open"], strict=True)]
        out[f"{name}_paired_diff_ms"] = statistics.median(diffs)
        out[f"{name}_paired_change"] = statistics.median(diffs) / open_p50
    out["runs_ms"] = ttfts
    return out


def bench_ttft(requests: int, seed: int, data: Path) -> dict[str, Any]:
    from kvflow.stages.api.client import InferenceClient
    from kvflow.stages.engine import write_demo_model

    model = write_demo_model(data / "tiny", preset="tiny", seed=seed)
    with contextlib.ExitStack() as stack:
        clients = {}
        for name in VARIANTS:
            cluster = stack.enter_context(_cluster(name, model, data))
            cluster.start(timeout_s=120)
            client = InferenceClient(cluster.addresses, max_attempts=1, tls=cluster.client_tls)
            clients[name] = stack.enter_context(client)
        return summarize_ttft(_interleaved(clients, requests, seed))


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="transfer rounds per variant")
    parser.add_argument("--reads", type=int, default=64, help="1 MiB reads per batch")
    parser.add_argument("--requests", type=int, default=30, help="TTFT rounds (one per cluster)")
    parser.add_argument("--no-ttft", action="store_true", help="transfer only (no clusters)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    return parser


def _line(report: dict[str, Any]) -> str:
    t, s = report["transfer"], report["tls_socket"]
    line = (
        f"auth cost: transfer 1 MiB reads {t['secret_gbps']:.2f} GB/s with the secret vs "
        f"{t['open_gbps']:.2f} open (paired {t['secret_paired_change']:+.1%}), handshake "
        f"{t['handshake_ms']:.2f} ms; TLS socket {s['tls_gbps']:.2f} vs plain "
        f"{s['plain_gbps']:.2f} GB/s (paired {s['tls_paired_change']:+.1%})"
    )
    if "ttft" in report:
        tt = report["ttft"]
        line += f"; TTFT p50 open {tt['open_ttft_p50_ms']:.1f} ms"
        for name in VARIANTS[1:]:
            line += (
                f", {name} {tt[f'{name}_ttft_p50_ms']:.1f} ms (paired "
                f"{tt[f'{name}_paired_diff_ms']:+.2f} ms, {tt[f'{name}_paired_change']:+.1%})"
            )
    load = report["loadavg_before"]
    return line + f"; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def run(args: argparse.Namespace) -> int:
    from kvflow.security.certs import generate_local_certs

    if min(args.repeats, args.reads, args.requests) < 1:
        raise SystemExit("--repeats, --reads, --requests: each must be >= 1")
    settings = {**vars(args), "json": str(args.json) if args.json else None}
    report: dict[str, Any] = {"loadavg_before": list(os.getloadavg()), "args": settings}
    with tempfile.TemporaryDirectory() as tmp:
        report["transfer"] = bench_transfer(args.repeats, args.reads, args.seed)
        certs = generate_local_certs(Path(tmp) / "tls")
        report["tls_socket"] = bench_tls_socket(
            certs.cert_file, certs.key_file, certs.ca_file, args.repeats, args.reads
        )
        if not args.no_ttft:
            report["ttft"] = bench_ttft(args.requests, args.seed, Path(tmp))
    report["loadavg_after"] = list(os.getloadavg())
    print(_line(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
