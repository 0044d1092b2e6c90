"""`kvflow serve --role meta`: one replica of the Raft metadata group and its gRPC service.

Runs until SIGINT/SIGTERM. Three of these (each listing the other two in ``--peers``) make a
group; kvdb nodes and routers reach it with ``RemoteMetadata`` on the three ``--grpc-port``
endpoints. The journal lives in ``<data-dir>/meta-<meta-id>``; restarting with the same
``--address``, ``--peers`` and directory replays it and catches up from the leader (a journal
is refused under another address or member list, or while another process holds it).

    python -m kvflow.tools.meta --meta-id 0 --address 127.0.0.1:7100 \\
        --peers 127.0.0.1:7101,127.0.0.1:7102 --grpc-port 7200 --data-dir data
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from kvflow.pipeline import Health, Metrics, MetricsServer, serve_metrics
from kvflow.pipeline.health import meta_ready
from kvflow.replication import MetadataConfig, MetadataGroup, ReplicationError
from kvflow.replication.journal_guard import JournalClaim, claim_journal_dir
from kvflow.replication.service import create_meta_server
from kvflow.security.bootstrap import host_of
from kvflow.tools.args import add_tls_flags, apply_cluster_secret, apply_tls

logger = logging.getLogger(__name__)

_DEFAULTS = MetadataConfig(self_address="127.0.0.1:1")


def add_meta_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the meta role's options. ``--data-dir`` and ``--host`` are reused when the parser
    already has them (``kvflow serve`` does)."""
    existing = parser._option_string_actions
    parser.add_argument("--meta-id", default="0", help="this replica's name (journal folder)")
    parser.add_argument("--address", help="this replica's Raft endpoint HOST:PORT (required)")
    parser.add_argument(
        "--peers",
        default="",
        help="comma-separated Raft endpoints of the group's replicas; this replica's own "
        "--address may be among them and is left out (every replica can get the same list)",
    )
    parser.add_argument("--grpc-port", type=int, default=0, help="metadata service port; 0 = any")
    if "--host" not in existing:
        parser.add_argument("--host", default="127.0.0.1", help="metadata service bind host")
    if "--metrics-port" not in existing:
        parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0 = off")
    if "--data-dir" not in existing:
        parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument(
        "--memory-journal", action="store_true", help="no journal files (state lost on exit)"
    )
    parser.add_argument("--commit-timeout-s", type=float, default=_DEFAULTS.commit_timeout_s)
    parser.add_argument("--node-dead-after-s", type=float, default=_DEFAULTS.node_dead_after_s)
    parser.add_argument("--raft-min-timeout-s", type=float, default=_DEFAULTS.raft_min_timeout_s)
    parser.add_argument("--raft-max-timeout-s", type=float, default=_DEFAULTS.raft_max_timeout_s)


def config_from_args(args: argparse.Namespace) -> MetadataConfig:
    """The replica's config; raises ValueError naming the bad option."""
    if not args.address:
        raise ValueError("--address: this replica's Raft endpoint HOST:PORT is required")
    if not str(args.meta_id) or "/" in str(args.meta_id):
        raise ValueError(f"--meta-id: expected a plain name, got {args.meta_id!r}")
    listed = (p.strip() for p in args.peers.split(","))
    peers = tuple(p for p in listed if p and p != args.address)
    journal = None if args.memory_journal else Path(args.data_dir) / f"meta-{args.meta_id}"
    return MetadataConfig(
        self_address=args.address,
        partner_addresses=peers,
        journal_dir=journal,
        commit_timeout_s=args.commit_timeout_s,
        node_dead_after_s=args.node_dead_after_s,
        raft_min_timeout_s=args.raft_min_timeout_s,
        raft_max_timeout_s=args.raft_max_timeout_s,
    )


def run_meta(args: argparse.Namespace) -> int:
    """Run one replica and its service until SIGINT/SIGTERM. Returns the exit code: 0 after
    a signal, 2 for bad options, 1 when the replica cannot start."""
    try:
        config = config_from_args(args)
        if not 0 <= args.grpc_port < 65536:
            raise ValueError(f"--grpc-port: expected 0..65535, got {args.grpc_port}")
    except ValueError as exc:
        print(f"kvflow meta: {exc}", file=sys.stderr)
        return 2
    claim: JournalClaim | None = None
    group = MetadataGroup(config)
    server = None
    metrics: MetricsServer | None = None
    stop = threading.Event()
    previous = _install_handlers(stop)
    try:
        if config.journal_dir is not None:
            claim = claim_journal_dir(
                config.journal_dir, config.self_address, config.partner_addresses
            )
        group.start()
        server, port = create_meta_server(group, args.host, args.grpc_port)
        server.start()
        metrics = _serve_metrics(group, args.host, args.metrics_port, stop)
        print(
            f"kvflow meta {args.meta_id}: raft {config.self_address} grpc {args.host}:{port} "
            f"peers {','.join(config.partner_addresses) or '-'} "
            f"journal {config.journal_dir or 'memory'}"
            + (f"; metrics on {metrics.url}" if metrics else ""),
            flush=True,
        )
        wait_for_stop(stop)
        return 0
    except ReplicationError as exc:
        print(f"kvflow meta: {exc}", file=sys.stderr)
        return 1
    finally:
        if metrics is not None:
            metrics.close()
        if server is not None:
            server.stop(grace=1.0).wait()
        group.close()
        if claim is not None:
            claim.release()
        _restore_handlers(previous)


def _serve_metrics(
    group: MetadataGroup, host: str, port: int, stop: threading.Event
) -> MetricsServer | None:
    """The replica's Prometheus endpoint (leadership and what the table holds) and its
    probes: live until it is told to stop, ready once it knows a leader and caught up."""
    if not port:
        return None
    metrics = Metrics()
    metrics.gauge("meta_is_leader", "1 while this replica leads the group").set_function(
        lambda: float(group.is_leader())
    )
    metrics.gauge("meta_blocks", "Blocks recorded in the metadata").set_function(
        lambda: float(group.view().num_blocks())
    )
    metrics.gauge("meta_nodes", "Nodes registered in the metadata").set_function(
        lambda: float(len(group.view().nodes()))
    )
    health = Health(live=lambda: "stopping" if stop.is_set() else None, ready=meta_ready(group))
    return serve_metrics(metrics, host, port, health)


_Handler = signal.Handlers | int | None | object


STOP_POLL_S = 0.5
"""How often the main thread, waiting for a signal, wakes to run a pending handler."""


def wait_for_stop(stop: threading.Event) -> None:
    """Return once ``stop`` is set (by the SIGINT/SIGTERM handler), waking every
    ``STOP_POLL_S``. Python runs a signal's handler in the main thread at its next bytecode,
    but the kernel may deliver the signal to any thread (grpc's and Raft's among them): a
    main thread blocked in ``stop.wait()`` is then never woken to run it. Seen in a loaded
    test run: a metadata replica ignored SIGTERM for 20 s, its main thread still waiting."""
    while not stop.wait(STOP_POLL_S):
        pass


def _install_handlers(stop: threading.Event) -> dict[int, _Handler]:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, frame: FrameType | None) -> None:
        logger.info("metadata replica: signal %d, stopping", signum)
        stop.set()

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_handlers(previous: dict[int, _Handler]) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvflow.tools.meta", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    add_meta_arguments(parser)
    add_tls_flags(parser, server=True)
    parser.add_argument(
        "--cluster-secret-file",
        type=Path,
        help="the cluster's secret (chmod 600); default: $KVFLOW_CLUSTER_SECRET_FILE, else "
        "DATA_DIR/cluster.secret (generated when every address is loopback)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        raft = (host_of(args.address),) if args.address else ()
        peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
        apply_cluster_secret(args, "meta", (args.host, *raft), peers)
        apply_tls(args)
    except (OSError, ValueError) as exc:
        print(f"kvflow meta: {exc}")
        return 2
    return run_meta(args)


if __name__ == "__main__":
    sys.exit(main())
