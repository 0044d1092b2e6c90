"""`kvflow serve --role node|router`: the processes of a multi-process cluster."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from kvflow.pipeline import serve_metrics
from kvflow.stages.api.inference import create_server
from kvflow.stages.serve.config import ServeConfig
from kvflow.stages.serve.embedded import ensure_model
from kvflow.stages.serve.node import NodeConfig, NodeServer
from kvflow.stages.serve.router import RouterServer, RouterSettings
from kvflow.tools.serve import engine_store_args


def _meta(args: argparse.Namespace) -> tuple[str, ...]:
    meta = tuple(a.strip() for a in args.meta.split(",") if a.strip())
    if not meta:
        raise ValueError("--meta: give the metadata replicas' gRPC addresses")
    return meta


def _model(args: argparse.Namespace) -> Path:
    return ensure_model(ServeConfig(model_dir=args.model, data_dir=args.data_dir, seed=args.seed))


async def _until_signal(stop: Callable[[], Awaitable[None]]) -> None:
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    try:
        await done.wait()
    finally:
        await stop()


def run_node(args: argparse.Namespace) -> int:
    try:
        config = NodeConfig(
            node_id=args.node_id or f"{args.kind}-{args.port}",
            kind=args.kind,
            model_dir=_model(args),
            meta=_meta(args),
            host=args.host,
            port=args.port,
            transfer_port=args.transfer_port,
            **engine_store_args(args),
        )
    except ValueError as exc:
        print(f"kvflow serve --role node: {exc}")
        return 2

    async def main() -> None:
        node = NodeServer(config)
        await node.start()
        print(
            f"kvflow node {config.node_id} ({config.kind}) on {node.address}, "
            f"transfer {node.transfer_address}",
            flush=True,
        )
        await _until_signal(node.stop)

    asyncio.run(main())
    return 0


def run_router(args: argparse.Namespace) -> int:
    try:
        settings = RouterSettings(
            model_dir=_model(args),
            meta=_meta(args),
            policy=args.policy,
            ttft_slo_s=None if args.ttft_slo_ms is None else args.ttft_slo_ms / 1000.0,
            tbt_slo_s=None if args.tbt_slo_ms is None else args.tbt_slo_ms / 1000.0,
            balancing_threshold=args.balancing_threshold,
            max_tokens_limit=args.max_tokens_limit,
            default_max_tokens=min(64, args.max_tokens_limit),
            instance_wait_s=args.instance_wait_s,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"kvflow serve --role router: {exc}")
        return 2

    async def main() -> None:
        router = RouterServer(settings)
        await router.start()
        server, port = create_server(router, args.host, args.port)  # type: ignore[arg-type]
        await server.start()
        metrics = (
            serve_metrics(router.metrics, args.host, args.metrics_port)
            if args.metrics_port
            else None
        )
        print(
            f"kvflow router on {args.host}:{port} ({len(router.prefill)} prefill, "
            f"{len(router.decode)} decode nodes)",
            flush=True,
        )

        async def stop() -> None:
            await server.stop(1.0)
            if metrics is not None:
                metrics.close()
            await router.stop()

        await _until_signal(stop)

    asyncio.run(main())
    return 0
