"""Benchmark the tcp transfer backend against a raw Python socket, two processes on loopback.

A server process (multiprocessing, spawn) holds one registered segment of seeded random bytes
and serves it with a TransferEngine; beside it, a raw socket server streams the same bytes with a
plain ``sendall`` loop. This process, for each value size (64 KiB, 1 MiB, 4 MiB by default):

- engine: one batch of ``--total-mib / size`` READ requests at seeded random value-aligned
  offsets (a remote batch get), submit + wait;
- raw: asks the raw server for the same number of values of that size and ``recv_into``s them
  back to back into one buffer (no protocol, no slicing);

alternating the two ``--repeats`` times (after one dropped warm-up run of each), so that both
see the same background load.

Reports the median GB/s of each and the ratio engine / raw. Prints one summary line;
``--json PATH`` writes every run.

    .venv/bin/python -m kvflow.tools.bench.transfer [--sizes 64K,1M,4M] [--total-mib 128]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.tools.bench._net import stop_server_process, timed_request
from kvflow.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest

SEGMENT_MIB = 128
_RAW_REQUEST = struct.Struct("<QQ")  # value size, value count


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def _label(size: int) -> str:
    return f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"


# ----- server process -------------------------------------------------------------------------


def _raw_serve(listener: socket.socket, data: memoryview, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header = bytearray(_RAW_REQUEST.size)
            while True:
                got = conn.recv_into(header)
                if got < len(header):
                    break
                size, count = _RAW_REQUEST.unpack(header)
                slots = len(data) // size
                for i in range(count):
                    start = (i % slots) * size
                    conn.sendall(data[start : start + size])


def _server_main(pipe: Connection, seed: int, config: TransferConfig) -> None:
    data = np.random.default_rng(seed).integers(0, 256, size=SEGMENT_MIB << 20, dtype=np.uint8)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()
    raw = threading.Thread(target=_raw_serve, args=(listener, memoryview(data), stop), daemon=True)
    raw.start()
    with TransferEngine(config) as engine:
        engine.register_memory("values", data)
        engine.start_server()
        pipe.send((engine.peer_address, listener.getsockname()[1]))
        pipe.recv()  # until the client says stop
    stop.set()
    listener.close()


# ----- client side ----------------------------------------------------------------------------


class _EngineGet:
    """Batch gets of ``count`` values of ``size`` bytes at random value-aligned offsets."""

    def __init__(self, engine: TransferEngine, peer: str, size: int, count: int) -> None:
        self.engine = engine
        self.target = engine.open_segment(peer, "values")
        self.size = size
        self.count = count
        self.name = f"dst-{size}"
        self.local = np.empty(size * count, dtype=np.uint8)
        engine.register_memory(self.name, self.local)

    def run(self, rng: np.random.Generator) -> float:
        size, count = self.size, self.count
        slots = self.target.size // size
        offsets = rng.choice(slots, size=count, replace=count > slots) * size
        requests = [
            TransferRequest(OpCode.READ, self.name, i * size, self.target, int(off), size)
            for i, off in enumerate(offsets)
        ]
        start = time.perf_counter()
        batch = self.engine.allocate_batch(count)
        self.engine.submit(batch, requests)
        statuses = self.engine.wait(batch, timeout=120)
        self.engine.free_batch(batch)
        elapsed = time.perf_counter() - start
        bad = [s for s in statuses if not s.ok]
        if bad:
            raise RuntimeError(f"transfer failed: {bad[0]}")
        return size * count / elapsed / 1e9

    def close(self) -> None:
        self.engine.unregister_memory(self.name)


class _RawGet:
    """The same bytes over one plain socket: sendall on the server, recv_into here."""

    def __init__(self, port: int, size: int, count: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.size = size
        self.count = count
        self.buffer = memoryview(bytearray(size * count))

    def run(self) -> float:
        return timed_request(self.sock, _RAW_REQUEST.pack(self.size, self.count), self.buffer)

    def close(self) -> None:
        self.sock.close()


def _measure(
    engine: TransferEngine,
    peer: str,
    raw_port: int,
    size: int,
    total_mib: int,
    repeats: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Alternate engine and raw runs (so both see the same background load); the first run of
    each warms up and is dropped."""
    count = max(1, (total_mib << 20) // size)
    getter = _EngineGet(engine, peer, size, count)
    raw = _RawGet(raw_port, size, count)
    engine_runs: list[float] = []
    raw_runs: list[float] = []
    try:
        for _ in range(repeats + 1):
            engine_runs.append(getter.run(rng))
            raw_runs.append(raw.run())
    finally:
        getter.close()
        raw.close()
    engine_gbps = statistics.median(engine_runs[1:])
    raw_gbps = statistics.median(raw_runs[1:])
    return {
        "size": size,
        "count": count,
        "engine_gbps": engine_gbps,
        "raw_gbps": raw_gbps,
        "ratio": engine_gbps / raw_gbps,
        "engine_runs": engine_runs[1:],
        "raw_runs": raw_runs[1:],
    }


def run_benchmark(
    sizes: Sequence[int], total_mib: int, repeats: int, seed: int, config: TransferConfig
) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=_server_main, args=(child, seed, config), daemon=True)
    server.start()
    results: list[dict[str, Any]] = []
    try:
        peer, raw_port = parent.recv()
        rng = np.random.default_rng(seed)
        with TransferEngine(config) as engine:
            for size in sizes:
                results.append(_measure(engine, peer, raw_port, size, total_mib, repeats, rng))
    finally:
        stop_server_process(parent, server)
    return {
        "benchmark": "transfer_tcp_loopback",
        "seed": seed,
        "total_mib": total_mib,
        "repeats": repeats,
        "cpus": os.cpu_count(),
        "config": {
            "connections_per_peer": config.connections_per_peer,
            "slice_size": config.slice_size,
        },
        "results": results,
    }


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64K,1M,4M", help="value sizes, e.g. 64K,1M,4M")
    parser.add_argument("--total-mib", type=int, default=128, help="bytes per batch, MiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per size")
    parser.add_argument("--connections", type=int, default=None, help="connections per peer")
    parser.add_argument("--slice-size", type=_parse_size, default=None, help="e.g. 1M")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write full results here")
    return parser


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench-transfer", help=__doc__.splitlines()[0])
    build_parser(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fields: dict[str, Any] = {"prefer_shm": False}  # measure tcp even though it is one host
    if args.connections is not None:
        fields["connections_per_peer"] = args.connections
    if args.slice_size is not None:
        fields["slice_size"] = args.slice_size
    sizes = [_parse_size(part) for part in args.sizes.split(",")]
    report = run_benchmark(sizes, args.total_mib, args.repeats, args.seed, TransferConfig(**fields))
    parts = [
        f"{_label(r['size'])} {r['engine_gbps']:.2f} GB/s (raw {r['raw_gbps']:.2f}, "
        f"{100 * r['ratio']:.0f}%)"
        for r in report["results"]
    ]
    print("transfer tcp loopback batch get: " + " | ".join(parts))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
