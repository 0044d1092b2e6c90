"""`kvflow serve`: the embedded cluster behind the gRPC inference API (the README's main job)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from kvflow.pipeline import serve_metrics
from kvflow.router import policy_names
from kvflow.stages.cluster import EmbeddedCluster
from kvflow.stages.config import ServeConfig
from kvflow.stages.engine import EngineError
from kvflow.stages.engine.default_model import ensure_default_model
from kvflow.stages.service import create_server
from kvflow.tools.meta import add_meta_arguments, run_meta

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the embedded cluster and its gRPC API")
    p.add_argument(
        "--role",
        default="embedded",
        choices=["embedded", "meta", "node", "router"],
        help="embedded: every instance in this process (default); meta: one Raft metadata "
        "replica; node: one prefill or decode node; router: the conductor and inference API",
    )
    p.add_argument(
        "--model",
        type=Path,
        help="Hugging Face model directory (default, embedded role: SmolLM2-135M-Instruct, "
        "imported on first run into DATA_DIR/models)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=9464, help="Prometheus port; 0 = off")
    p.add_argument("--data-dir", type=Path, default=Path("data"))
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--policy", default="cache-aware", choices=policy_names())
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-pages", type=int, default=512, help="KV pages per engine")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--dram-mb", type=int, default=1024, help="DRAM tier per shard, MiB")
    p.add_argument("--ssd-mb", type=int, default=8192, help="SSD tier per shard, MiB")
    p.add_argument("--storage-engine", default="rocksdb", choices=["rocksdb", "lmdb"])
    p.add_argument("--ttft-slo-ms", type=float, help="reject requests predicted to miss it")
    p.add_argument("--tbt-slo-ms", type=float, help="reject requests predicted to miss it")
    p.add_argument("--balancing-threshold", type=float, default=2.0)
    p.add_argument("--max-tokens-limit", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    cluster = p.add_argument_group("--role node / router")
    cluster.add_argument("--meta", default="", help="metadata replicas' gRPC HOST:PORT, comma list")
    cluster.add_argument("--node-id", default="", help="this node's name (--role node)")
    cluster.add_argument("--kind", choices=["prefill", "decode"], default="prefill")
    cluster.add_argument("--transfer-port", type=int, default=0, help="0 = any free port")
    cluster.add_argument(
        "--instance-wait-s",
        type=float,
        default=30.0,
        help="(router) how long a request waits for a healthy prefill/decode node",
    )
    meta = p.add_argument_group("--role meta")
    add_meta_arguments(meta)  # type: ignore[arg-type]
    p.set_defaults(func=run)


def engine_store_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine and shard settings that the embedded server and a node take alike."""
    return {
        "data_dir": args.data_dir,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "num_pages": args.num_pages,
        "prefill_chunk": args.prefill_chunk,
        "dram_capacity_bytes": args.dram_mb << 20,
        "ssd_capacity_bytes": args.ssd_mb << 20,
        "storage_engine": args.storage_engine,
        "seed": args.seed,
    }


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        model_dir=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        policy=args.policy,
        **engine_store_args(args),
        ttft_slo_s=None if args.ttft_slo_ms is None else args.ttft_slo_ms / 1000.0,
        tbt_slo_s=None if args.tbt_slo_ms is None else args.tbt_slo_ms / 1000.0,
        balancing_threshold=args.balancing_threshold,
        max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=min(64, args.max_tokens_limit),
    )


async def serve(config: ServeConfig, host: str, port: int, metrics_port: int) -> None:
    cluster = EmbeddedCluster(config)
    await cluster.start()
    server, bound = create_server(cluster, host, port)
    await server.start()
    metrics = serve_metrics(cluster.metrics, host, metrics_port) if metrics_port else None
    print(
        f"kvflow serving {cluster.model_dir} on {host}:{bound} "
        f"({config.num_prefill} prefill, {config.num_decode} decode, policy {config.policy})"
        + (f"; metrics on {metrics.url}" if metrics else ""),
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        print("kvflow: shutting down", flush=True)
        await server.stop(grace=2.0)
        if metrics is not None:
            metrics.close()
        await cluster.stop()


def _say(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.role == "meta":
        return run_meta(args)
    if args.role in ("node", "router"):
        from kvflow.tools.cluster_roles import run_node, run_router

        return run_node(args) if args.role == "node" else run_router(args)
    try:
        if args.model is None:
            args.model = ensure_default_model(args.data_dir, progress=_say)
        config = config_from_args(args)
    except (ValueError, EngineError) as exc:
        print(f"kvflow serve: {exc}")
        return 2
    asyncio.run(serve(config, args.host, args.port, args.metrics_port))
    return 0
