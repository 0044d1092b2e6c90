"""Benchmark the metadata group: blocks registered per second, batched, 1 and 3 replicas.

All replicas run in this process on loopback ports, each with a file journal in a temporary
directory. One writer on the leader registers ``--blocks`` random 16-byte keys in batches of
``--batch`` (one Raft entry per batch, ``record_batch``), waiting for each commit; the clock
stops when every replica has applied the last batch. Prints one summary line; ``--json PATH``
writes the full results.

    .venv/bin/python -m kvflow.tools.bench_metadata [--blocks N] [--batch B] [--replicas 1,3]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvflow.replication import MetadataConfig, MetadataGroup, NodeId, Tier

READY_TIMEOUT_S = 30.0


def _free_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _start_group(replicas: int, journal_root: Path | None) -> list[MetadataGroup]:
    addresses = [_free_address() for _ in range(replicas)]
    groups = []
    for i, address in enumerate(addresses):
        config = MetadataConfig(
            self_address=address,
            partner_addresses=tuple(a for a in addresses if a != address),
            journal_dir=None if journal_root is None else journal_root / f"replica-{i}",
            commit_timeout_s=30.0,
            raft_min_timeout_s=0.25,
            raft_max_timeout_s=0.6,
        )
        groups.append(MetadataGroup(config))
    for group in groups:
        group.start()
    for group in groups:
        group.wait_ready(READY_TIMEOUT_S)
    return groups


def _wait_applied(groups: list[MetadataGroup], node: NodeId, expected: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while any(g.view().blocks_on(node) < expected for g in groups):
        if time.monotonic() > deadline:
            raise TimeoutError("replicas did not apply every batch in time")
        time.sleep(0.001)


def run_one(replicas: int, blocks: int, batch: int, seed: int, journal: bool) -> dict[str, Any]:
    """Register ``blocks`` keys in batches on a fresh group of ``replicas``; return results."""
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(blocks)]
    batches = [[(k, Tier.DRAM) for k in keys[i : i + batch]] for i in range(0, blocks, batch)]
    node = NodeId("bench-node")
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-meta-") as tmp:
        groups = _start_group(replicas, Path(tmp) if journal else None)
        try:
            leader = next(g for g in groups if g.is_leader())
            latencies = []
            start = time.perf_counter()
            for i, items in enumerate(batches):
                t0 = time.perf_counter()
                leader.record_batch(node, items, (), now=float(i))
                latencies.append(time.perf_counter() - t0)
            committed_s = time.perf_counter() - start
            _wait_applied(groups, node, blocks)
            all_applied_s = time.perf_counter() - start
            entries = int(leader.raft_status()["commit_idx"])
        finally:
            for group in groups:
                group.close()
    latencies.sort()
    return {
        "replicas": replicas,
        "blocks": blocks,
        "batch": batch,
        "batches": len(batches),
        "journal": journal,
        "commit_idx": entries,
        "committed_s": committed_s,
        "all_applied_s": all_applied_s,
        "blocks_per_s": blocks / all_applied_s,
        "batch_latency_p50_ms": 1e3 * statistics.median(latencies),
        "batch_latency_p99_ms": 1e3
        * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def _parse_replicas(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part]
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError("--replicas: comma-separated counts >= 1, e.g. 1,3")
    return counts


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="bench_metadata", description=__doc__)
    parser.add_argument("--blocks", type=int, default=200_000, help="keys to register")
    parser.add_argument("--batch", type=int, default=1000, help="keys per record_batch call")
    parser.add_argument("--replicas", type=_parse_replicas, default=[1, 3], help="e.g. 1,3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-journal", action="store_true", help="no journal files")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="full results")
    parser.set_defaults(func=run)
    return parser


def register(subparsers: Any) -> None:
    build_parser(
        subparsers.add_parser("bench-metadata", help="metadata group registration throughput")
    )


def run(args: argparse.Namespace) -> int:
    if args.blocks < 1 or args.batch < 1:
        print("bench_metadata: --blocks and --batch must be >= 1", file=sys.stderr)
        return 2
    results = [
        run_one(n, args.blocks, args.batch, args.seed, not args.memory_journal)
        for n in args.replicas
    ]
    parts = [
        f"{r['replicas']} replica(s) {r['blocks_per_s'] / 1e3:.0f}k blocks/s "
        f"(p50 {r['batch_latency_p50_ms']:.1f} ms/batch)"
        for r in results
    ]
    print(f"bench_metadata: {args.blocks} blocks in batches of {args.batch}: " + ", ".join(parts))
    if args.json is not None:
        args.json.write_text(json.dumps({"seed": args.seed, "results": results}, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
