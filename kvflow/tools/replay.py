"""`kvflow replay`: route a Mooncake trace through the simulated cluster, per policy.

Prints one table row per policy (TTFT p50/p90/p99, TBT, rejection rate, cache hit ratio, pulls,
requests/s); ``--json`` prints the full reports as JSON instead, ``--json PATH`` writes them to
PATH as well as printing the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvflow.router import SimulationConfig, SimulationReport, policy_names, read_trace, simulate

HEADER = (
    f"{'policy':<18} {'served':>6} {'reject%':>7} {'ttft_mean':>9} {'ttft_p50':>8} "
    f"{'ttft_p90':>8} {'ttft_p99':>8} {'tbt_mean':>8} {'hit%':>6} {'pulls':>6} {'req/s':>6}"
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay", help="replay a request trace through the router's simulator"
    )
    parser.add_argument("--trace", required=True, type=Path, help="Mooncake-format JSONL trace")
    parser.add_argument("--prefill", type=int, default=8, help="prefill instances")
    parser.add_argument("--decode", type=int, default=4, help="decode instances")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--policy", choices=policy_names(), default="cache-aware")
    group.add_argument("--all-policies", action="store_true", help="run every policy")
    parser.add_argument("--start", type=int, default=0, help="first record to replay")
    parser.add_argument("--limit", type=int, default=None, help="records to replay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-blocks", type=int, default=10_000, help="per-instance LRU size")
    parser.add_argument("--threshold", type=float, default=2.0, help="kvcache balancing ratio")
    parser.add_argument("--ttft-slo", type=float, default=None, help="seconds; default none")
    parser.add_argument("--tbt-slo", type=float, default=None, help="seconds; default none")
    parser.add_argument("--bandwidth", type=float, default=25e9, help="bytes/s per holder link")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply inter-arrival times"
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="print full JSON reports (no PATH) or also write them to PATH",
    )
    parser.set_defaults(func=run)


def _config(args: argparse.Namespace, policy: str) -> SimulationConfig:
    base = SimulationConfig(
        num_prefill=args.prefill,
        num_decode=args.decode,
        cache_capacity_blocks=args.cache_blocks,
        bandwidth_bytes_per_s=args.bandwidth,
        time_scale=args.time_scale,
    )
    router = replace(
        base.router,
        policy=policy,
        seed=args.seed,
        balancing_threshold=args.threshold,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
    )
    return replace(base, router=router)


def _row(r: SimulationReport) -> str:
    return (
        f"{r.policy:<18} {r.served:>6} {100 * r.rejection_rate:>7.1f} {r.ttft_mean_s:>9.3f} "
        f"{r.ttft_p50_s:>8.3f} {r.ttft_p90_s:>8.3f} {r.ttft_p99_s:>8.3f} {r.tbt_mean_s:>8.4f} "
        f"{100 * r.cache_hit_ratio:>6.1f} {r.pulls:>6} {r.requests_per_s:>6.2f}"
    )


def run(args: argparse.Namespace) -> int:
    try:
        records = read_trace(args.trace, start=args.start, limit=args.limit)
        policies = policy_names() if args.all_policies else (args.policy,)
        configs = [_config(args, p) for p in policies]
    except (OSError, ValueError) as exc:
        print(f"kvflow replay: {exc}", file=sys.stderr)
        return 2
    reports = [simulate(c, records) for c in configs]
    document = {
        "trace": str(args.trace),
        "start": args.start,
        "records": len(records),
        "prefill": args.prefill,
        "decode": args.decode,
        "seed": args.seed,
        "reports": [r.to_dict() for r in reports],
    }
    if args.json == "-":
        print(json.dumps(document, indent=2))
        return 0
    if args.json is not None:
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(f"{len(records)} requests, {args.prefill} prefill + {args.decode} decode instances")
    print(HEADER)
    for report in reports:
        print(_row(report))
    return 0
