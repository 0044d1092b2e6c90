"""Benchmark the metadata group: blocks registered per second, batched, 1 and 3 replicas.

Default mode: all replicas run in this process on loopback ports, each with a file journal in
a temporary directory. One writer on the leader registers ``--blocks`` random 16-byte keys in
batches of ``--batch`` (one Raft entry per batch, ``record_batch``), waiting for each commit;
the clock stops when every replica has applied the last batch.

``--processes``: 3 replica processes (``python -m kvflow.tools.meta``, journals in a temporary
directory); ``--writers`` client threads register the keys through ``RemoteMetadata`` over
gRPC (the clock stops when every replica reports all blocks), then the leader is killed
(SIGKILL) ``--kills`` times: re-election time = from the kill until a write through
``RemoteMetadata`` succeeds again; the killed replica is restarted from its journal and
caught up before the next kill. Prints one summary line; ``--json PATH`` writes the full
results.

    .venv/bin/python -m kvflow.tools.bench.metadata [--blocks N] [--batch B] [--replicas 1,3]
    .venv/bin/python -m kvflow.tools.bench.metadata --processes [--kills 5] [--writers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvflow.replication import (
    MetadataConfig,
    MetadataGroup,
    NodeId,
    RemoteMetadata,
    ReplicationError,
    Tier,
)
from kvflow.security import SECRET_FILE_ENV
from kvflow.tools.args import free_port
from kvflow.tools.supervise import LocalMetaProcesses

READY_TIMEOUT_S = 30.0


def _free_address() -> str:
    return f"127.0.0.1:{free_port()}"


def _start_group(replicas: int, journal_root: Path | None) -> list[MetadataGroup]:
    addresses = [_free_address() for _ in range(replicas)]
    password = secrets.token_hex(16)  # the group's own: a group never runs open
    groups = []
    for i, address in enumerate(addresses):
        config = MetadataConfig(
            self_address=address,
            partner_addresses=tuple(a for a in addresses if a != address),
            journal_dir=None if journal_root is None else journal_root / f"replica-{i}",
            commit_timeout_s=30.0,
            raft_min_timeout_s=0.25,
            raft_max_timeout_s=0.6,
            password=password,
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


def _agreed_leader(probes: list[RemoteMetadata]) -> int:
    """Index of the one replica that leads and that every answering replica agrees on."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        statuses = []
        for probe in probes:
            try:
                statuses.append(probe.view().status())
            except ReplicationError:
                statuses.append(None)
        heads = [i for i, st in enumerate(statuses) if st is not None and st.is_leader]
        live = [st for st in statuses if st is not None]
        if len(heads) == 1 and all(st.leader == live[0].leader for st in live):
            return heads[0]
        time.sleep(0.01)
    raise TimeoutError("no agreed metadata leader")


def _wait_caught_up(probes: list[RemoteMetadata], i: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            statuses = [probe.view().status() for probe in probes]
        except ReplicationError:
            time.sleep(0.02)
            continue
        applied = {st.commands_applied for st in statuses}
        if statuses[i].ready and len(applied) == 1:
            return
        time.sleep(0.02)
    raise TimeoutError(f"replica {i} did not catch up")


def _register_remote(
    client: RemoteMetadata, batches: list[list[tuple[bytes, Tier]]], writers: int
) -> list[float]:
    """Write every batch from ``writers`` threads (each takes the next batch); latencies."""
    node = NodeId("bench-node")
    lock = threading.Lock()
    todo = iter(range(len(batches)))
    latencies: list[float] = []
    failures: list[BaseException] = []

    def write() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            t0 = time.perf_counter()
            try:
                client.record_batch(node, batches[i], (), now=float(i))
            except BaseException as exc:
                failures.append(exc)
                return
            with lock:
                latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=write, name=f"bench-writer-{w}") for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return latencies


def run_processes(blocks: int, batch: int, writers: int, kills: int, seed: int) -> dict[str, Any]:
    """3 replica processes: registration throughput over gRPC, then ``kills`` leader kills."""
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(blocks)]
    batches = [[(k, Tier.DRAM) for k in keys[i : i + batch]] for i in range(0, blocks, batch)]
    with (
        tempfile.TemporaryDirectory(prefix="kvflow-bench-meta-") as tmp,
        LocalMetaProcesses(Path(tmp)) as procs,
    ):
        os.environ.setdefault(SECRET_FILE_ENV, str(procs.secret_file))  # the clients' secret
        procs.start_all()
        probes = [RemoteMetadata([a], 1.0, 0.5, cache_ttl_s=0) for a in procs.grpc]
        client = RemoteMetadata(procs.grpc, timeout_s=60.0)
        try:
            client.wait_ready(READY_TIMEOUT_S)
            _agreed_leader(probes)
            client.start()  # learn the leader: writes go there first
            start = time.perf_counter()
            latencies = _register_remote(client, batches, writers)
            committed_s = time.perf_counter() - start
            deadline = time.monotonic() + READY_TIMEOUT_S
            while any(p.view().num_blocks() < blocks for p in probes):
                if time.monotonic() > deadline:
                    raise TimeoutError("replicas did not apply every batch in time")
                time.sleep(0.002)
            all_applied_s = time.perf_counter() - start
            reelection: list[float] = []
            for _ in range(kills):
                leader = _agreed_leader(probes)
                procs.kill(leader)
                t0 = time.perf_counter()
                client.heartbeat(NodeId("bench-probe"))  # retried until a new leader commits
                reelection.append(time.perf_counter() - t0)
                procs.start(leader)  # restart from its journal; catch up before the next kill
                _wait_caught_up(probes, leader)
        finally:
            client.close()
            for probe in probes:
                probe.close()
    latencies.sort()
    return {
        "replicas": 3,
        "processes": True,
        "blocks": blocks,
        "batch": batch,
        "writers": writers,
        "committed_s": committed_s,
        "all_applied_s": all_applied_s,
        "blocks_per_s": blocks / all_applied_s,
        "batch_latency_p50_ms": 1e3 * statistics.median(latencies),
        "batch_latency_p99_ms": 1e3
        * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "reelection_s": reelection,
        "reelection_median_s": statistics.median(reelection),
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
    parser.add_argument(
        "--processes", action="store_true", help="3 replica processes over gRPC + leader kills"
    )
    parser.add_argument("--kills", type=int, default=5, help="leader kills (--processes)")
    parser.add_argument("--writers", type=int, default=1, help="client threads (--processes)")
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
    if args.processes:
        return _run_processes(args)
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


def _run_processes(args: argparse.Namespace) -> int:
    if args.kills < 1 or args.writers < 1:
        print("bench_metadata: --kills and --writers must be >= 1", file=sys.stderr)
        return 2
    result = run_processes(args.blocks, args.batch, args.writers, args.kills, args.seed)
    print(
        f"bench_metadata: 3 replica processes, {args.blocks} blocks in batches of {args.batch}"
        f" ({args.writers} writer(s)): {result['blocks_per_s'] / 1e3:.0f}k blocks/s "
        f"(p50 {result['batch_latency_p50_ms']:.1f} ms/batch); re-election after a leader "
        f"kill: median {result['reelection_median_s']:.2f} s over {args.kills} kills"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"seed": args.seed, "processes": result}, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
