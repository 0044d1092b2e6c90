"""`kvflow serve`: one process of kvflow. ``--role embedded`` (the default, the README's main
job) runs every instance in this process behind the gRPC inference API; ``meta``, ``node`` and
``router`` are the processes of a multi-process cluster (DESIGN's Processes table). Each role's
composition root is a module of ``kvflow.stages.serve``; this module parses flags, builds the
role's config, serves its metrics and waits for SIGINT/SIGTERM.

Heavy imports (torch, the servers) happen when a role runs, so ``kvflow --help`` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from kvflow.router import policy_names
from kvflow.tools.args import (
    add_engine_store_flags,
    add_security_flags,
    address_list,
    apply_cluster_secret,
    apply_tls,
    authenticator_from_args,
    check_api_exposure,
    engine_store_values,
    memory_plan,
)
from kvflow.tools.meta import add_meta_arguments, run_meta


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run kvflow (embedded, or one role of a cluster)")
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
        "imported on first run into DATA_DIR/models; node and router roles: the demo model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="the address every listener binds")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus port; 0 = off (default: embedded and router 9464, node 9465, meta 9466, "
        "so roles that share a host do not collide)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="(embedded, router) the OpenAI-compatible and SGLang-native HTTP APIs, in the "
        "gRPC server's process and event loop; 0 = off (default 8000, as vLLM's)",
    )
    p.add_argument(
        "--served-model-name",
        help="(embedded, router) the model's name in the APIs (default: the model "
        "directory's name)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        help="(HTTP) a larger request body is refused with 413 before it is read",
    )
    add_engine_store_flags(p)
    add_security_flags(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument(
        "--colocate",
        action=argparse.BooleanOptionalAction,
        help="(embedded) prefill instance i and decode instance i share one engine: one copy "
        "of the weights, every core, prefill chunks mixed into decode steps (needs "
        "--prefill = --decode); default: colocated on a machine of at most 2 cores, else "
        "disaggregated; see docs/performance.md",
    )
    p.add_argument("--policy", default="cache-aware", choices=policy_names())
    p.add_argument("--ttft-slo-ms", type=float, help="reject requests predicted to miss it")
    p.add_argument("--tbt-slo-ms", type=float, help="reject requests predicted to miss it")
    p.add_argument("--balancing-threshold", type=float, default=2.0)
    p.add_argument("--max-tokens-limit", type=int, default=4096)
    limits = p.add_argument_group("limits per request and tenant (embedded, router)")
    limits.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=1 << 20,
        help="the largest prompt text; gRPC refuses larger messages before reading them",
    )
    limits.add_argument(
        "--max-upload-bytes",
        type=int,
        default=8 << 20,
        help="the largest warm-up corpus file one gRPC Submit may carry",
    )
    limits.add_argument(
        "--tenant-max-concurrency", type=int, help="requests in flight per tenant (default: any)"
    )
    limits.add_argument(
        "--tenant-rate", type=float, help="requests a second per tenant (token bucket)"
    )
    limits.add_argument("--tenant-burst", type=int, help="the bucket's size (default: the rate)")
    queue = p.add_argument_group("the admission queue (embedded, router)")
    queue.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests that may wait for a place; the next gets HTTP 429 / RESOURCE_EXHAUSTED",
    )
    queue.add_argument(
        "--max-queued-tokens",
        type=int,
        default=1 << 22,
        help="tokens (prompt + max_tokens) the waiting requests may hold together",
    )
    queue.add_argument(
        "--max-running-requests",
        type=int,
        default=128,
        help="the most requests running at once (fewer while the engines have no room)",
    )
    queue.add_argument(
        "--queue-timeout-s",
        type=float,
        default=300.0,
        help="the longest a request waits in the queue before it is refused (429)",
    )
    p.add_argument(
        "--drain-s",
        type=float,
        default=10.0,
        help="(embedded, router) on SIGTERM: refuse new requests (HTTP 503, gRPC UNAVAILABLE; "
        "/readyz turns 503) and let those in flight finish for up to this long, then exit",
    )
    timeouts = p.add_argument_group("HTTP connections (embedded, router)")
    timeouts.add_argument(
        "--http-header-timeout-s",
        type=float,
        default=10.0,
        help="close a connection whose request headers are not all in within this",
    )
    timeouts.add_argument(
        "--http-body-timeout-s",
        type=float,
        default=30.0,
        help="answer 408 to a request whose body is not all in within this",
    )
    timeouts.add_argument(
        "--http-keep-alive-s", type=float, default=5.0, help="close idle keep-alive connections"
    )
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


def _slo(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _routing(args: argparse.Namespace) -> dict[str, Any]:
    """The routing flags shared by the embedded server and a router."""
    return {
        "policy": args.policy,
        "ttft_slo_s": _slo(args.ttft_slo_ms),
        "tbt_slo_s": _slo(args.tbt_slo_ms),
        "balancing_threshold": args.balancing_threshold,
        "max_tokens_limit": args.max_tokens_limit,
        "default_max_tokens": min(64, args.max_tokens_limit),
        "max_prompt_bytes": args.max_prompt_bytes,
        "max_upload_bytes": args.max_upload_bytes,
        "tenant_max_concurrency": args.tenant_max_concurrency,
        "tenant_rate_per_s": args.tenant_rate,
        "tenant_burst": args.tenant_burst,
        "max_queued_requests": args.max_queued_requests,
        "max_queued_tokens": args.max_queued_tokens,
        "max_running_requests": args.max_running_requests,
        "queue_timeout_s": args.queue_timeout_s,
    }


def colocated(args: argparse.Namespace) -> bool:
    """Whether this embedded server colocates its instances (colocation.py decides)."""
    from kvflow.stages.runtime.threads import cores
    from kvflow.stages.serve.colocation import embedded_colocate

    return embedded_colocate(args.colocate, args.prefill, args.decode, cores(), args.device)


def weight_copies(num_prefill: int, num_decode: int, colocate: bool) -> int:
    """Engines that load weights of their own: colocated, one per prefill/decode pair."""
    return num_prefill if colocate else num_prefill + num_decode


def config_from_args(args: argparse.Namespace, plan: Any, colocate: bool | None = None) -> Any:
    """The embedded server's config; ``colocate``: already decided (None: decided here)."""
    from kvflow.stages.serve.config import ServeConfig

    return ServeConfig(
        model_dir=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        colocate=colocated(args) if colocate is None else colocate,
        served_model_name=args.served_model_name,
        **engine_store_values(args, plan),
        **_routing(args),
    )


def http_config(args: argparse.Namespace) -> Any:
    """The HTTP front's config, or None when --http-port is 0."""
    from kvflow.stages.serve.config import HttpConfig

    if not args.http_port:
        return None
    return HttpConfig(
        port=args.http_port,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.http_header_timeout_s,
        body_timeout_s=args.http_body_timeout_s,
        keep_alive_s=args.http_keep_alive_s,
    )


async def _start_http(
    frontend: Any, host: str, config: Any, auth: Any, stack: contextlib.AsyncExitStack
) -> Any:
    """The HTTP front on ``host`` in this event loop (behind the same API keys as gRPC;
    stopped by ``stack``), or None when it is off."""
    if config is None:
        return None
    from kvflow.stages.api.http_app import HttpServer

    server = HttpServer(frontend, host, config, auth=auth)
    await server.start()
    stack.push_async_callback(server.stop)
    return server


def _http_line(http: Any) -> str:
    return f"; HTTP (OpenAI, SGLang) on {http.url}" if http is not None else ""


def _started(what: str, serve: Callable[[], None]) -> int:
    """Run ``serve``; 0 when it returns. A start that cannot proceed (a data dir held by
    another process or damaged beyond repair, a port in use, no metadata group, a model the
    engine cannot load on its device) is one line on stderr, naming the cause, and exit code
    1; the supervisor reads that line."""
    from kvflow.kvdb.errors import KVDBError
    from kvflow.replication.errors import ReplicationError
    from kvflow.stages.engine import EngineError

    try:
        serve()
    except (KVDBError, ReplicationError, EngineError, OSError) as exc:
        print(f"{what}: cannot start: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 1
    return 0


@contextlib.contextmanager
def _interruptible_startup() -> Iterator[None]:
    """While start-up runs, SIGINT (Ctrl-C) and SIGTERM raise KeyboardInterrupt at once,
    wherever the main thread is (a model loading synchronously included); the exit stack of
    the caller then stops what already started. asyncio.run's own handler only cancels the
    main task at its next await: a Ctrl-C 5 s into a 9 s start-up used to wait 4-7 s for
    start-up to end, then exit without stopping what it had started (once with SIGSEGV)."""

    signalled: list[str] = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        signalled.append(signal.Signals(signum).name)
        raise KeyboardInterrupt(signalled[-1])

    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, interrupt) for sig in sigs}
    try:
        yield
    except Exception as exc:
        if signalled:  # native code (safetensors) turns the interrupt into its own error
            raise KeyboardInterrupt(signalled[0]) from exc
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_on_signal() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets, from now on. Call it right after start-up
    (`_interruptible_startup` puts the previous handlers back when it ends) and before the
    line that says the role serves: a SIGTERM sent on that line (a supervisor, a test, a
    kubelet) then stops the role cleanly, instead of meeting the default action and killing
    it (seen in a loaded test run: exit -15, nothing stopped)."""
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    return done


async def _until_signal(done: asyncio.Event) -> None:
    """Serve until `done` (`_stop_on_signal`) is set; the caller's exit stack then stops
    everything."""
    loop = asyncio.get_running_loop()
    try:
        await done.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        print("kvflow: shutting down", flush=True)


def _metrics(
    registry: Any, host: str, port: int, stack: contextlib.AsyncExitStack, health: Any = None
) -> Any:
    """The metrics endpoint with the ``/healthz`` and ``/readyz`` probes of ``health`` (closed
    by ``stack``), or None when ``port`` is 0."""
    from kvflow.pipeline import serve_metrics

    if not port:
        return None
    metrics = serve_metrics(registry, host, port, health)
    stack.callback(metrics.close)
    return metrics


def _health(ready: Any, stack: contextlib.AsyncExitStack) -> Any:
    """The probes' answers: live while this event loop ticks (a task ``stack`` cancels),
    ready when ``ready`` (pipeline/health.py) says so."""
    from kvflow.pipeline import Health, LoopPulse

    pulse = LoopPulse()
    task = asyncio.get_running_loop().create_task(pulse.run())
    stack.callback(task.cancel)
    return Health(live=pulse.check, ready=ready)


async def _drain(frontend: Any, health: Any, drain_s: float) -> None:
    """A graceful stop: readiness fails at once, new requests are refused (503/UNAVAILABLE,
    so clients go to another replica), and those in flight get up to ``drain_s`` to end."""
    health.draining = True
    frontend.admission.close("draining: this server is shutting down")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_s
    while not frontend.admission.idle() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    left = frontend.admission.running() + frontend.admission.waiting()
    print(
        "kvflow: drained"
        if not left
        else f"kvflow: drain ended after {drain_s:g} s, {left} requests still in flight",
        flush=True,
    )


async def serve_embedded(
    config: Any,
    host: str,
    port: int,
    metrics_port: int,
    http: Any = None,
    auth: Any = None,
    drain_s: float = 10.0,
) -> None:
    from kvflow.pipeline.health import frontend_ready
    from kvflow.stages.api.inference import create_server
    from kvflow.stages.serve.embedded import EmbeddedCluster
    from kvflow.stages.serve.warmup import attach_warmup

    async with contextlib.AsyncExitStack() as stack:  # stops, in reverse, what started
        with _interruptible_startup():
            cluster = EmbeddedCluster(config)
            stack.push_async_callback(cluster.stop)
            await cluster.start()
            server, bound = create_server(cluster, host, port, auth)
            warmup = attach_warmup(
                server, cluster, config.data_dir / "warmup", embedded=True, auth=auth
            )
            await server.start()
            stack.push_async_callback(server.stop, 2.0)
            await warmup.start()
            stack.push_async_callback(warmup.stop)
            http_server = await _start_http(cluster, host, http, auth, stack)
            health = _health(frontend_ready(cluster), stack)
            metrics = _metrics(cluster.metrics, host, metrics_port, stack, health)
        stop = _stop_on_signal()
        print(
            f"kvflow serving {cluster.model_name} ({cluster.model_dir}) on {host}:{bound} "
            f"({config.num_prefill} prefill, {config.num_decode} decode, policy "
            f"{config.policy})"
            + _http_line(http_server)
            + (f"; metrics on {metrics.url}" if metrics else ""),
            flush=True,
        )
        await _until_signal(stop)
        await _drain(cluster, health, drain_s)


def run_node(args: argparse.Namespace) -> int:
    from kvflow.pipeline.health import node_ready
    from kvflow.stages.engine import EngineError, openmp
    from kvflow.stages.engine.allocator import tune_malloc
    from kvflow.stages.serve.build import ensure_model
    from kvflow.stages.serve.config import EngineStoreConfig, NodeConfig
    from kvflow.stages.serve.node import NodeServer

    openmp.reserve()  # for the process's life: only the engine's thread builds a team
    tune_malloc()  # before any thread: one malloc arena (allocator.py)
    try:
        args.model = ensure_model(
            EngineStoreConfig(model_dir=args.model, data_dir=args.data_dir, seed=args.seed)
        )
        plan = memory_plan(args, args.model, engines=1, shards=1)
        if args.kind != "prefill":  # only a prefilling engine's pages are written at start
            plan = dataclasses.replace(plan, kv_prefault=False)
        config = NodeConfig(
            node_id=args.node_id or f"{args.kind}-{args.port}",
            kind=args.kind,
            model_dir=args.model,
            meta=address_list(args.meta, "--meta"),
            host=args.host,
            port=args.port,
            transfer_port=args.transfer_port,
            **engine_store_values(args, plan),
        )
    except (ValueError, EngineError) as exc:
        print(f"kvflow serve --role node: {exc}")
        return 2
    print(f"kvflow node {config.node_id}: {plan.describe()}", flush=True)

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            with _interruptible_startup():
                node = NodeServer(config)
                stack.push_async_callback(node.stop)
                await node.start()
                health = _health(node_ready(node), stack)
                metrics = _metrics(node.metrics, args.host, args.metrics_port, stack, health)
            stop = _stop_on_signal()
            print(
                f"kvflow node {config.node_id} ({config.kind}) on {node.address}, "
                f"transfer {node.transfer_address}"
                + (f"; metrics on {metrics.url}" if metrics else ""),
                flush=True,
            )
            await _until_signal(stop)
            health.draining = True  # routers stop sending on their next refresh

    return _started("kvflow serve --role node", lambda: asyncio.run(main()))


def run_router(args: argparse.Namespace) -> int:
    from kvflow.pipeline.health import frontend_ready
    from kvflow.stages.api.inference import create_server
    from kvflow.stages.serve.build import ensure_model
    from kvflow.stages.serve.config import EngineStoreConfig, RouterSettings
    from kvflow.stages.serve.router import RouterServer
    from kvflow.stages.serve.warmup import attach_warmup

    try:
        model = ensure_model(
            EngineStoreConfig(model_dir=args.model, data_dir=args.data_dir, seed=args.seed)
        )
        auth = authenticator_from_args(args)
        settings = RouterSettings(
            model_dir=model,
            meta=address_list(args.meta, "--meta"),
            instance_wait_s=args.instance_wait_s,
            seed=args.seed,
            served_model_name=args.served_model_name,
            **_routing(args),
        )
        http = http_config(args)
    except ValueError as exc:
        print(f"kvflow serve --role router: {exc}")
        return 2

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            with _interruptible_startup():
                router = RouterServer(settings)
                stack.push_async_callback(router.stop)
                await router.start()
                server, port = create_server(router, args.host, args.port, auth)
                jobs_dir = Path(args.data_dir) / f"warmup-router-{args.port or port}"
                warmup = attach_warmup(server, router, jobs_dir, embedded=False, auth=auth)
                await server.start()
                stack.push_async_callback(server.stop, 1.0)
                await warmup.start()
                stack.push_async_callback(warmup.stop)
                http_server = await _start_http(router, args.host, http, auth, stack)
                health = _health(frontend_ready(router), stack)
                metrics = _metrics(router.metrics, args.host, args.metrics_port, stack, health)
            stop = _stop_on_signal()
            print(
                f"kvflow router on {args.host}:{port} ({len(router.prefill)} prefill, "
                f"{len(router.decode)} decode nodes)"
                + _http_line(http_server)
                + (f"; metrics on {metrics.url}" if metrics else ""),
                flush=True,
            )
            await _until_signal(stop)
            await _drain(router, health, args.drain_s)

    return _started("kvflow serve --role router", lambda: asyncio.run(main()))


def _say(line: str) -> None:
    print(line, flush=True)


def _binds_and_peers(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The hosts this role listens on and the ``HOST:PORT`` of the peers it joins (what
    decides whether it may generate its own cluster secret)."""
    from kvflow.security.bootstrap import host_of

    def split(value: str | None) -> tuple[str, ...]:
        return tuple(a.strip() for a in (value or "").split(",") if a.strip())

    if args.role == "meta":
        raft = (host_of(args.address),) if args.address else ()
        return (args.host, *raft), split(args.peers)
    if args.role in ("node", "router"):
        return (args.host,), split(args.meta)
    return (args.host,), ()


METRICS_PORTS = {"embedded": 9464, "router": 9464, "node": 9465, "meta": 9466}


def run(args: argparse.Namespace) -> int:
    if args.metrics_port is None:
        args.metrics_port = METRICS_PORTS[args.role]
    try:
        if args.drain_s < 0:
            raise ValueError(f"--drain-s: expected seconds >= 0, got {args.drain_s:g}")
        binds, peers = _binds_and_peers(args)
        apply_cluster_secret(args, args.role, binds, peers)  # light: meta starts without torch
        if args.role in ("embedded", "router"):
            check_api_exposure(args)
        apply_tls(args)
        if args.role in ("embedded", "node"):  # before a model is fetched or read
            from kvflow.stages.engine.config import require_device

            require_device(args.device)
    except (OSError, ValueError) as exc:
        print(f"kvflow serve: {exc}")
        return 2
    if args.role == "meta":
        return run_meta(args)
    if args.role == "node":
        return run_node(args)
    if args.role == "router":
        return run_router(args)
    from kvflow.stages.engine import EngineError, openmp
    from kvflow.stages.engine.allocator import tune_malloc
    from kvflow.stages.engine.default_model import ensure_default_model

    openmp.reserve()  # for the process's life: only engine threads build teams
    tune_malloc()  # before any thread: one malloc arena (allocator.py)
    try:
        if args.model is None:
            args.model = ensure_default_model(args.data_dir, progress=_say)
        auth = authenticator_from_args(args)
        # every instance has an engine and a shard (DESIGN: decode instances store too)
        instances = args.prefill + args.decode
        # a colocated prefill and decode instance share one engine: one copy of the weights
        plan = memory_plan(args, args.model, engines=instances, shards=instances)
        colocate = colocated(args)  # after the plan's checks: a bad flag is the only line
        copies = weight_copies(args.prefill, args.decode, colocate)
        plan = dataclasses.replace(plan, weight_copies=copies)
        config = config_from_args(args, plan, colocate)
        http = http_config(args)
    except (ValueError, EngineError) as exc:
        print(f"kvflow serve: {exc}")
        return 2
    print(f"kvflow: {plan.describe()}", flush=True)
    return _started(
        "kvflow serve",
        lambda: asyncio.run(
            serve_embedded(
                config, args.host, args.port, args.metrics_port, http, auth, args.drain_s
            )
        ),
    )
