"""`bench_kvdb --remote`: remote batch get_into between two processes on loopback, against a
raw Python socket moving the same bytes.

A holder process (multiprocessing, spawn) opens one DRAM shard per value size (64 KiB, 1 MiB,
4 MiB by default) filled with seeded random values, registers the DRAM pools with a
TransferEngine server and serves the BlockService over gRPC; beside it a raw socket server
streams the same values out of the same pools with a plain ``sendall`` loop. This process, per
size, alternates:

- remote: ``RemoteClient.batch_get_into(keys, pages)``: Lease RPC, one transfer batch of READs
  (tcp backend, shm off) straight into views of one registered destination array, xxh3 check
  of every block, Release RPC;
- raw: one request to the raw server, then ``recv_into`` the same number of bytes back to back
  into one buffer (no protocol, no checksums);

after one dropped warm-up of each, ``repeat`` times. Reports median GB/s of each, their ratio
(and the median of the per-round ratios: both sides of a round see the same background load),
and the median cost of a lease + release round trip alone.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import struct
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvflow.kvdb import (
    KVLayout,
    Namespace,
    NodeId,
    RemoteClient,
    Shard,
    ShardRef,
    StaticAdminSource,
    StoreConfig,
    add_block_service,
    block_keys,
)
from kvflow.tools.bench._net import stop_server_process, timed_request
from kvflow.transfer import TransferConfig, TransferEngine

_RAW_REQUEST = struct.Struct("<QQ")  # size index, value count
_TOKENS_PER_BLOCK = 16


def _namespace(size: int) -> Namespace:
    per_layer = 2 * 4 * _TOKENS_PER_BLOCK * 64 * 2  # k/v, 4 heads, 16 tokens, dim 64, bf16
    return Namespace("bench", "bench-remote", KVLayout(size // per_layer, 4, 64, 16, "bfloat16"))


def _keys(size: int, count: int) -> list[bytes]:
    return list(block_keys(_namespace(size), list(range(count * _TOKENS_PER_BLOCK))))


# ----- holder process -----------------------------------------------------------------------


def _open_shard(size: int, count: int, seed: int) -> tuple[Shard, list[memoryview]]:
    cfg = StoreConfig(
        engine="memory",
        dram_capacity_bytes=size * count + (1 << 20),
        ssd_capacity_bytes=0,
        high_watermark=1.0,
        low_watermark=0.9,
        value_size=size,
        dram_prefault=True,
    )
    shard = Shard(cfg, _namespace(size).fingerprint())
    rng = np.random.default_rng(seed + size)
    keys = _keys(size, count)
    for i, key in enumerate(keys):
        shard.put(key, rng.integers(0, 256, size, dtype=np.uint8), keys[i - 1] if i else None)
    leased = shard.lease_dram(keys, promote=False)  # where each value lies, for the raw sender
    shard.release_dram(keys)
    pool = memoryview(shard.dram_pool)  # type: ignore[arg-type]
    return shard, [pool[b.offset : b.offset + b.nbytes] for b in leased]


def _raw_serve(listener: socket.socket, values: list[list[memoryview]]) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header = bytearray(_RAW_REQUEST.size)
            while conn.recv_into(header, len(header), socket.MSG_WAITALL) == len(header):
                index, count = _RAW_REQUEST.unpack(header)
                for view in values[index][:count]:
                    conn.sendall(view)


def holder_main(pipe: Connection, sizes: list[int], counts: list[int], seed: int) -> None:
    """The holder process: shards, transfer server, BlockService, raw server; runs until the
    parent sends anything on ``pipe``."""
    import grpc

    opened = [_open_shard(size, count, seed) for size, count in zip(sizes, counts, strict=True)]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    raw = threading.Thread(target=_raw_serve, args=(listener, [v for _, v in opened]), daemon=True)
    raw.start()
    source = StaticAdminSource(
        {
            str(size): ShardRef(shard, NodeId("holder"), "prefill")
            for size, (shard, _) in zip(sizes, opened, strict=True)
        }
    )
    transfer = TransferEngine(TransferConfig(prefer_shm=False))
    transfer.start_server()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    blocks = add_block_service(server, source, transfer)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        pipe.send((f"127.0.0.1:{port}", transfer.peer_address, listener.getsockname()[1]))
        pipe.recv()
    finally:
        server.stop(None).wait()
        blocks.close()
        transfer.close()
        listener.close()
        for shard, _ in opened:
            shard.close()


# ----- reader side --------------------------------------------------------------------------


class _RawReader:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def run(self, index: int, count: int, buf: memoryview) -> float:
        return timed_request(self.sock, _RAW_REQUEST.pack(index, count), buf)

    def close(self) -> None:
        self.sock.close()


def _measure(
    client: RemoteClient, raw: _RawReader, index: int, size: int, count: int, repeat: int
) -> dict[str, Any]:
    keys = _keys(size, count)
    dst = np.zeros(size * count, dtype=np.uint8)  # fault the pages in before timing
    name = client.register_destination(dst)
    pages = [dst[i * size : (i + 1) * size] for i in range(count)]
    raw_buf = memoryview(bytearray(size * count))
    remote_runs: list[float] = []
    raw_runs: list[float] = []
    lease_ms: list[float] = []
    try:
        for _ in range(repeat + 1):
            start = time.perf_counter()
            got = client.batch_get_into(keys, pages)
            elapsed = time.perf_counter() - start
            if None in got:
                raise RuntimeError(f"remote read missed {got.count(None)} of {count} blocks")
            remote_runs.append(size * count / elapsed / 1e9)
            raw_runs.append(raw.run(index, count, raw_buf))
            start = time.perf_counter()
            client.release(client.lease(keys))
            lease_ms.append((time.perf_counter() - start) * 1e3)
        if dst.tobytes() != raw_buf.tobytes():
            raise RuntimeError("remote and raw reads returned different bytes")
    finally:
        client.unregister_destination(name)
    remote = statistics.median(remote_runs[1:])
    raw_gbps = statistics.median(raw_runs[1:])
    return {
        "size": size,
        "count": count,
        "remote_gbps": remote,
        "raw_gbps": raw_gbps,
        "ratio": remote / raw_gbps,
        "ratio_per_round": statistics.median(
            a / b for a, b in zip(remote_runs[1:], raw_runs[1:], strict=True)
        ),
        "lease_release_ms": statistics.median(lease_ms[1:]),
        "remote_runs": remote_runs[1:],
        "raw_runs": raw_runs[1:],
    }


def run_remote(
    sizes: Sequence[int], working_set_mib: int, repeat: int, seed: int
) -> dict[str, Any]:
    """Start the holder, measure every size, stop the holder; returns the full results."""
    counts = [max(4, (working_set_mib << 20) // size) for size in sizes]
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    holder = context.Process(
        target=holder_main, args=(child, list(sizes), counts, seed), daemon=True
    )
    holder.start()
    results: list[dict[str, Any]] = []
    try:
        if not parent.poll(120):
            raise RuntimeError("holder process did not start within 120 s")
        control, peer, raw_port = parent.recv()
        with TransferEngine(TransferConfig(prefer_shm=False)) as transfer:
            raw = _RawReader(raw_port)
            try:
                for index, (size, count) in enumerate(zip(sizes, counts, strict=True)):
                    with RemoteClient(control, transfer, peer, shard=str(size)) as client:
                        results.append(_measure(client, raw, index, size, count, repeat))
            finally:
                raw.close()
    finally:
        stop_server_process(parent, holder)
    return {
        "benchmark": "kvdb_remote_batch_get_into",
        "seed": seed,
        "working_set_mib": working_set_mib,
        "repeat": repeat,
        "cpus": os.cpu_count(),
        "results": results,
    }


def label(size: int) -> str:
    return f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"


def summary(report: dict[str, Any]) -> str:
    parts = [
        f"{label(r['size'])} {r['remote_gbps']:.2f} GB/s (raw {r['raw_gbps']:.2f}, "
        f"{100 * r['ratio']:.0f}%)"
        for r in report["results"]
    ]
    return "kvdb remote batch_get_into, 2 processes, tcp loopback: " + " | ".join(parts)
