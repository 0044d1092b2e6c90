"""Benchmark the conductor's routing decision: p50/p99 of ``Conductor.route``, 16-256 instances.

Setup (seeded): ``--blocks`` distinct block keys (1M by default) cut into prefix chains of
``--chain`` blocks; each chain is held, up to a random depth, by 1-3 random prefill instances
(so about 2 holders per block). Each prefill instance has 0-4 queued requests (one running) and
each decode instance (``instances // 2`` of them) 0-15 decoding ones. A request takes a random
chain's first 1..chain blocks plus 0-4 blocks nobody holds.

Indexes:
  * ``local``: the in-process :class:`LocalPrefixIndex` (key -> holders reverse map);
  * ``metadata``: :class:`MetadataPrefixIndex` over an in-process ``MetadataView`` of a
    ``MetadataTable`` holding the same facts (what a router reads; the gRPC view adds one RPC on
    a holders-cache miss, not measured here);
  * with ``--per-instance``, also each index wrapped so that the conductor can only call
    ``match`` once per instance (the code before ``match_all``), for comparison in the same run;
  * with ``--reference``, also each index routed by :class:`ReferenceConductor` (``*-reference``:
    the per-instance conductor before vectorised scoring, same decisions), in the same run.

Only ``route`` is timed (the decision; ``commit`` is not), in wall time and in this thread's CPU
time (``time.thread_time_ns``: excludes the time spent waiting for a core on a shared machine).
Prints one summary line; ``--json PATH`` writes every result and the load average.

    python -m kvflow.tools.bench.router [--instances 16,64,256] [--blocks 1000000] [--reference]
        [--json out]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.replication import MetadataTable, MetadataView, NodeId, Tier
from kvflow.router import (
    Conductor,
    DecodeTimeModel,
    InstanceKind,
    InstanceState,
    LocalPrefixIndex,
    MetadataPrefixIndex,
    PrefillTimeModel,
    PrefixIndex,
    RouterConfig,
    RouteRequest,
    TransferEstimator,
)
from kvflow.router.reference import ReferenceConductor

BLOCK_SIZE = 512
PREFILL = PrefillTimeModel((0.03, 1.1e-4, 1.05e-9, 6.5e-6), "bench")
DECODE = DecodeTimeModel((0.025, 3e-4, 4e-8), "bench")


class PerInstanceIndex:
    """Hides ``match_all``: the conductor falls back to one ``match`` per instance."""

    def __init__(self, inner: PrefixIndex) -> None:
        self._inner = inner

    def match(self, instance_id: str, keys: Sequence[bytes]) -> int:
        return self._inner.match(instance_id, keys)


@dataclass(frozen=True)
class Layout:
    chains: list[list[bytes]]
    holdings: dict[str, list[bytes]]  # instance -> keys it holds


def _layout(instances: int, blocks: int, chain: int, rng: random.Random) -> Layout:
    ids = [f"prefill-{i}" for i in range(instances)]
    chains = [
        [(c * chain + j).to_bytes(8, "big") for j in range(chain)] for c in range(blocks // chain)
    ]
    holdings: dict[str, list[bytes]] = {i: [] for i in ids}
    for keys in chains:
        for holder in rng.sample(ids, rng.randint(1, min(3, instances))):
            holdings[holder].extend(keys[: rng.randint(1, chain)])
    return Layout(chains, holdings)


def _local_index(layout: Layout) -> LocalPrefixIndex:
    index = LocalPrefixIndex()
    for instance_id, keys in layout.holdings.items():
        index.insert(instance_id, keys)
    return index


def _metadata_index(layout: Layout) -> MetadataPrefixIndex:
    table = MetadataTable()
    for instance_id, keys in layout.holdings.items():
        for start in range(0, len(keys), 50_000):
            part = keys[start : start + 50_000]
            table.record_batch(NodeId(instance_id), [(k, Tier.DRAM) for k in part], (), 0.0)
    return MetadataPrefixIndex(MetadataView.of_table(table))


def _states(instances: int, rng: random.Random) -> tuple[list[InstanceState], list[InstanceState]]:
    prefill = [InstanceState(f"prefill-{i}", InstanceKind.PREFILL) for i in range(instances)]
    decode = [InstanceState(f"decode-{i}", InstanceKind.DECODE) for i in range(instances // 2)]
    for state in prefill:
        for j in range(rng.randint(0, 4)):
            state.enqueue(f"q{j}", rng.uniform(0.05, 2.0))
            if j == 0:
                state.start("q0", 0.0)
    for state in decode:
        for j in range(rng.randint(0, 15)):
            state.add_decode(f"d{j}", rng.randint(1_000, 30_000))
    return prefill, decode


def _requests(layout: Layout, count: int, rng: random.Random) -> list[RouteRequest]:
    out = []
    for n in range(count):
        chain = rng.choice(layout.chains)
        fresh = [f"new-{n}-{j}".encode() for j in range(rng.randint(0, 4))]
        keys = tuple(chain[: rng.randint(1, len(chain))]) + tuple(fresh)
        out.append(RouteRequest(f"bench-{n}", keys, len(keys) * BLOCK_SIZE))
    return out


def _time_routes(
    index: PrefixIndex,
    prefill: list[InstanceState],
    decode: list[InstanceState],
    requests: Sequence[RouteRequest],
    freeze_gc: bool,
    reference: bool = False,
) -> dict[str, float]:
    config = RouterConfig(block_size=BLOCK_SIZE, block_nbytes=BLOCK_SIZE * 327_680)
    router = ReferenceConductor if reference else Conductor
    conductor = router(config, index, PREFILL, DECODE, TransferEstimator(25e9, 1e-3))
    for req in requests[:50]:  # warm-up
        conductor.route(req, prefill, decode, now=0.5)
    if freeze_gc:
        gc.collect()
        gc.freeze()  # the index's millions of long-lived objects leave the collector's scans
    samples = []
    cpu_samples = []
    for req in requests:
        start, cpu_start = time.perf_counter_ns(), time.thread_time_ns()
        conductor.route(req, prefill, decode, now=0.5)
        samples.append(time.perf_counter_ns() - start)
        cpu_samples.append(time.thread_time_ns() - cpu_start)
    ms = np.array(samples, dtype=float) / 1e6
    cpu_ms = np.array(cpu_samples, dtype=float) / 1e6
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        # this thread's CPU time per decision: what the decision costs, without the time the
        # thread waited for a core on a shared machine
        "cpu_p50_ms": float(np.percentile(cpu_ms, 50)),
        "cpu_p99_ms": float(np.percentile(cpu_ms, 99)),
        "decisions": len(samples),
    }


def run_bench(
    instance_counts: Sequence[int],
    blocks: int,
    chain: int,
    decisions: int,
    seed: int,
    per_instance: bool,
    freeze_gc: bool,
    reference: bool = False,
) -> list[dict[str, Any]]:
    results = []
    for instances in instance_counts:
        rng = random.Random(seed)
        layout = _layout(instances, blocks, chain, rng)
        prefill, decode = _states(instances, rng)
        requests = _requests(layout, decisions, rng)
        indexes: dict[str, PrefixIndex] = {
            "local": _local_index(layout),
            "metadata": _metadata_index(layout),
        }
        for name, index in list(indexes.items()):
            if per_instance:
                indexes[f"{name}-per-instance"] = PerInstanceIndex(index)
        held = sum(len(k) for k in layout.holdings.values())
        runs = [(name, index, False) for name, index in indexes.items()]
        if reference:
            runs += [(f"{name}-reference", indexes[name], True) for name in ("local", "metadata")]
        for name, index, with_reference in runs:
            stats = _time_routes(index, prefill, decode, requests, freeze_gc, with_reference)
            results.append(
                {
                    "index": name,
                    "prefill_instances": instances,
                    "decode_instances": len(decode),
                    "blocks": blocks,
                    "replicas_indexed": held,
                    "gc_frozen": freeze_gc,
                    **stats,
                }
            )
            print(
                f"  {name:<22} {instances:>4} prefill: p50 {stats['p50_ms']:.3f} ms "
                f"p99 {stats['p99_ms']:.3f} ms (cpu p50 {stats['cpu_p50_ms']:.3f} "
                f"p99 {stats['cpu_p99_ms']:.3f} ms)",
                file=sys.stderr,
            )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_router", description=__doc__.splitlines()[0])
    parser.add_argument("--instances", default="16,64,256", help="prefill instance counts")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="distinct blocks indexed")
    parser.add_argument("--chain", type=int, default=64, help="blocks per prefix chain")
    parser.add_argument("--decisions", type=int, default=2_000, help="timed routing decisions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--per-instance", action="store_true", help="also time one match per instance"
    )
    parser.add_argument(
        "--reference", action="store_true", help="also time the per-instance ReferenceConductor"
    )
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the index's objects to the cyclic GC (a server would gc.freeze() them)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.instances.split(",") if x]
    if not counts or min(counts) < 2 or args.blocks < args.chain or args.chain < 1:
        parser.error("need --instances >= 2 each and --blocks >= --chain >= 1")
    results = run_bench(
        counts,
        args.blocks,
        args.chain,
        args.decisions,
        args.seed,
        args.per_instance,
        not args.no_gc_freeze,
        args.reference,
    )
    if args.json is not None:
        doc = {
            "seed": args.seed,
            "blocks": args.blocks,
            "loadavg_after": os.getloadavg(),
            "results": results,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(
        "bench_router: "
        + "; ".join(
            f"{r['index']}@{r['prefill_instances']} p50 {r['p50_ms']:.3f} p99 {r['p99_ms']:.3f} ms"
            for r in results
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
