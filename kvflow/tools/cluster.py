"""`kvflow cluster`: start and supervise a multi-process cluster on this machine.

    kvflow cluster --meta 3 --prefill 2 --decode 1 [--routers 2] [--model DIR] [--host H]
                   [--port 50051] [--http-port 8000] [--port-base N] [--api-key-file F]
                   [--data-dir DIR] [--tls]

starts 3 metadata replicas, the prefill and decode nodes and the routers (gRPC on --port and
the ports after it, HTTP on --http-port and the ports after it), each as its own
`kvflow serve --role ...` process listening on --host; every other port comes from
--port-base (docs/cluster.md: which process gets which) or, without it, is a free one. It
restarts any process that dies, and stops them all on Ctrl-C. The
supervisor itself is ``kvflow.tools.supervise.LocalCluster`` (also used by the benchmarks and
tests). Clients that list every router (`kvflow generate --server A,B`) fail over when one dies.
``--tls``: every gRPC and HTTP port serves TLS (a local CA in DATA_DIR/tls; clients pass
``--tls-ca DATA_DIR/tls/ca.pem``).
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("cluster", help="start and supervise a local multi-process cluster")
    p.add_argument("--meta", type=int, default=3)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--routers", type=int, default=2, help="routers, on --port and the next ports")
    p.add_argument("--model", type=Path)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address every process listens on and registers (a node's peers and the "
        "routers reach it there: give this host's own address, not 0.0.0.0)",
    )
    p.add_argument(
        "--port", type=int, default=50051, help="routers' gRPC: this port and the next ones"
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="routers' HTTP (OpenAI, SGLang APIs): this port and the next ones; 0 = free ports",
    )
    p.add_argument(
        "--port-base",
        type=int,
        default=0,
        help="every other port (Raft, metadata gRPC, nodes, transfer, metrics) is N, N+1, ... "
        "in the order docs/cluster.md gives; 0 = free ports",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        help="handed to every router: clients' keys, lines 'KEY TENANT user|admin'",
    )
    p.add_argument("--data-dir", type=Path, default=Path("data/cluster"))
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda[:N]: where the prefill and decode nodes run their engines",
    )
    p.add_argument("--policy", default="cache-aware")
    p.add_argument(
        "--tls",
        action="store_true",
        help="TLS on every gRPC and HTTP port: a local CA and a certificate for "
        "127.0.0.1/localhost, generated into DATA_DIR/tls (clients: --tls-ca DATA_DIR/tls/ca.pem)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvflow.security.bootstrap import is_loopback
    from kvflow.stages.api.auth import ApiKeys
    from kvflow.tools.supervise import LocalCluster, check_port_base

    check_port_base(args.port_base)  # the user's mistakes, before the model import (seconds)
    if args.device != "cpu":
        from kvflow.stages.engine.config import require_device

        require_device(args.device)
    if args.api_key_file is not None:  # refused here, in one line, not in every router's log
        ApiKeys.load(args.api_key_file)
        args.api_key_file = args.api_key_file.resolve()
    elif not is_loopback(args.host):  # the routers would refuse it (docs/security.md)
        raise ValueError(
            f"--host {args.host} serves the inference API beyond loopback: pass --api-key-file"
        )
    if args.model is None:  # every process must serve the same model: import it once here
        from kvflow.stages.engine.default_model import ensure_default_model

        args.model = ensure_default_model(args.data_dir, progress=lambda s: print(s, flush=True))

    cluster = LocalCluster(
        args.data_dir,
        args.meta,
        args.prefill,
        args.decode,
        args.model,
        args.port,
        extra=() if args.device == "cpu" else ("--device", args.device),
        router_extra=("--policy", args.policy),
        routers=args.routers,
        tls=args.tls,
        host=args.host,
        http_port=args.http_port,
        port_base=args.port_base,
        api_key_file=args.api_key_file,
    )
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
        routers = ",".join(cluster.addresses)
        print(
            f"kvflow cluster: routers on {routers}; metadata on "
            f"{','.join(cluster.meta_addresses)}; logs in {cluster.data_dir}",
            flush=True,
        )
        ca = f" --tls-ca {cluster.client_tls.ca_file}" if args.tls else ""
        print(f"  try: kvflow generate --server {routers}{ca} --prompt 'Hello'", flush=True)
        print(f"  HTTP (OpenAI, SGLang APIs): {', '.join(cluster.http_urls)}", flush=True)
        for name, port in cluster.node_ports.items():
            where = f"{args.host}:{port}"
            transfer = cluster.transfer_ports[name]
            also = f", transfer {transfer}" if transfer else ""
            print(f"  {name}: {where}{also}   (kvflow kvdb --server {where} shards)")
        ports = " ".join(f"{name}={port}" for name, port in cluster.metrics_ports.items())
        print(f"  Prometheus metrics (http://{args.host}:PORT/metrics): {ports}", flush=True)
        reported: set[str] = set()
        while not stop["now"]:
            cluster.supervise_once()
            for name, why in cluster.failed().items():
                if name not in reported:
                    reported.add(name)
                    print(f"kvflow cluster: {name} FAILED, not restarted: {why}", flush=True)
            time.sleep(0.5)
    except RuntimeError as exc:
        print(f"kvflow cluster: {exc}")
        return 1
    finally:
        print("kvflow cluster: stopping", flush=True)
        cluster.stop()
    return 0
