"""`kvflow kvdb`: the kvdb admin CLI over a server's gRPC KVAdmin service.

    kvflow kvdb --server HOST:PORT [--api-key KEY] nodes | shards | tiers
                | replicas KEY [--tenant T] | hot [-n N] [--tenant T] | stats [--tenant T]
                | evict --shard ID --tier dram|ssd --bytes N    [--json]

With a user key (``--api-key``) hot, replicas and stats show only the key's tenant and the other
actions are PERMISSION_DENIED; an admin key (or the cluster token) sees every tenant and may
filter hot, replicas and stats with ``--tenant``. On a router those three are the nodes'
answers merged; the nodes that did not answer are listed after the table. Aligned tables by
default; ``--json`` prints JSON (nodes/shards/tiers/hot: a list with one object per row). A
gRPC error prints its code and details on stderr and exits 1; bad local arguments exit 2
(argparse).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvflow.kvdb import InvalidRequestError
from kvflow.kvdb.admin import MAX_HOT, TIER_NAMES, parse_key
from kvflow.kvdb.proto import pb2, pb2_grpc
from kvflow.tools.args import add_tls_flags, apply_tls
from kvflow.tools.caller import add_api_key_flag, add_server_flag, open_stub

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


# ----------------------------------------------------------------------------- argument types


def _size(text: str) -> int:
    """Bytes from ``N``, ``64K``, ``1M``, ``2G`` (binary units; a trailing B/iB is allowed)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        value = int(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 64K, 1M)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= n <= MAX_HOT:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_HOT}], got {n}")
    return n


def _key(text: str) -> str:
    try:
        return parse_key(text).hex()
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ----------------------------------------------------------------------------- output


def to_plain(msg: Any) -> dict[str, Any]:
    """A protobuf message as a dict of every field (defaults included, 64-bit ints as ints)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None:
            if field.is_repeated:
                out[field.name] = [to_plain(v) for v in value]
            else:
                out[field.name] = to_plain(value)
        elif field.is_repeated:
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An aligned text table: numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in headers]] + [[_cell(c) for c in row] for row in rows]
    numeric = [
        all(isinstance(row[i], int | float) for row in rows) and bool(rows)
        for i in range(len(headers))
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [
            r[i].rjust(widths[i]) if numeric[i] else r[i].ljust(widths[i])
            for i in range(len(headers))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _usage(u: Any) -> str:
    return f"{human_bytes(u.used_bytes)} / {human_bytes(u.capacity_bytes)}"


# ----------------------------------------------------------------------------- commands

Command = Callable[[Any, argparse.Namespace], tuple[Any, str]]
"""(stub, args) -> (JSON-able value, table text)."""


def _nodes(stub: Any, args: argparse.Namespace) -> tuple[Any, str]:
    reply = stub.Nodes(pb2.NodesRequest(), timeout=args.timeout)
    rows = [
        [
            n.node,
            n.kind or "-",
            n.address or "-",
            "yes" if n.healthy else "NO",
            n.blocks,
            f"{n.heartbeat_age_s:.1f}s ago" if n.has_heartbeat else "-",
            n.shard or "-",
        ]
        for n in reply.nodes
    ]
    text = table(["NODE", "KIND", "ADDRESS", "HEALTHY", "BLOCKS", "HEARTBEAT", "SHARD"], rows)
    return [to_plain(n) for n in reply.nodes], f"{text}\n{reply.total_blocks} distinct blocks"


def _shards(stub: Any, args: argparse.Namespace) -> tuple[Any, str]:
    reply = stub.Shards(pb2.ShardsRequest(), timeout=args.timeout)
    rows = [
        [
            s.shard,
            s.node,
            s.kind or "-",
            s.engine,
            s.dram.blocks,
            _usage(s.dram),
            s.ssd.blocks,
            _usage(s.ssd),
            s.pinned_blocks,
            "closed" if s.closed else "open",
        ]
        for s in reply.shards
    ]
    headers = ["SHARD", "NODE", "KIND", "ENGINE", "DRAM BLOCKS", "DRAM USED", "SSD BLOCKS"]
    headers += ["SSD USED", "PINNED", "STATE"]
    return [to_plain(s) for s in reply.shards], table(headers, rows)


def _tiers(stub: Any, args: argparse.Namespace) -> tuple[Any, str]:
    reply = stub.Tiers(pb2.TiersRequest(shard=args.shard), timeout=args.timeout)
    rows = [
        [
            t.shard,
            t.tier,
            t.hits,
            t.misses,
            f"{100 * t.hit_rate:.1f}%",
            human_bytes(t.bytes_read),
            human_bytes(t.bytes_written),
            t.evictions,
            t.demotions,
            t.promotions,
            t.corruptions,
            t.blocks,
            _usage(t),
        ]
        for t in reply.tiers
    ]
    headers = ["SHARD", "TIER", "HITS", "MISSES", "HIT RATE", "READ", "WRITTEN", "EVICTIONS"]
    headers += ["DEMOTIONS", "PROMOTIONS", "CORRUPT", "BLOCKS", "USED"]
    return [to_plain(t) for t in reply.tiers], table(headers, rows)


def _skipped(reply: Any, text: str) -> str:
    """``text`` and, from a router, the nodes that did not answer (their blocks are missing)."""
    if not reply.skipped_nodes:
        return text
    return f"{text}\nnot answering, left out: {', '.join(reply.skipped_nodes)}"


def _replicas(stub: Any, args: argparse.Namespace) -> tuple[Any, str]:
    request = pb2.ReplicasRequest(key=args.key, tenant=args.tenant)
    reply = stub.Replicas(request, timeout=args.timeout)
    rows = [[r.node, r.tier, r.source, r.shard or "-"] for r in reply.replicas]
    head = f"key {reply.key}"
    if reply.has_metadata:
        head += f", replica target {reply.replica_target}"
    body = table(["NODE", "TIER", "SOURCE", "SHARD"], rows) if rows else "no replicas"
    return to_plain(reply), _skipped(reply, f"{head}\n{body}")


def _hot(stub: Any, args: argparse.Namespace) -> tuple[Any, str]:
    request = pb2.HotRequest(n=args.n, shard=args.shard, tenant=args.tenant)
    reply = stub.Hot(request, timeout=args.timeout)
    rows = [
        [b.key, b.hits, b.tier, b.tenant, b.shard, b.node, human_bytes(b.nbytes), b.pins]
        for b in reply.blocks
    ]
    text = table(["KEY", "HITS", "TIER", "TENANT", "SHARD", "NODE", "SIZE", "PINS"], rows)
    text = text if rows else "no block has been read yet"
    return [to_plain(b) for b in reply.blocks], _skipped(reply, text)


def _stats(stub: Any, args: argparse.Namespace) -> tuple[Any, str]:
    request = pb2.StatsRequest(shard=args.shard, reset=args.reset, tenant=args.tenant)
    reply = stub.Stats(request, timeout=args.timeout)
    owned = [
        [t.tenant, t.shard, t.blocks, t.dram_blocks, t.ssd_blocks, human_bytes(t.bytes), t.hits]
        for t in reply.tenants
    ]
    owned_text = table(["TENANT", "SHARD", "BLOCKS", "DRAM", "SSD", "SIZE", "HITS"], owned)
    if not reply.shards:  # a user key: only its tenant's holdings
        return to_plain(reply), _skipped(reply, owned_text if owned else "no shards")
    rows = [
        [
            s.shard,
            s.puts,
            s.rejected_puts,
            s.gets,
            s.dram_hits,
            s.ssd_hits,
            s.misses,
            s.corruptions,
            f"{100 * s.hit_rate:.1f}%",
            human_bytes(s.bytes_read),
            human_bytes(s.bytes_written),
        ]
        for s in [*reply.shards, reply.total]
    ]
    headers = ["SHARD", "PUTS", "REJECTED", "GETS", "DRAM HITS", "SSD HITS", "MISSES"]
    headers += ["CORRUPT", "HIT RATE", "READ", "WRITTEN"]
    text = table(headers, rows)
    return to_plain(reply), _skipped(reply, f"{text}\n\n{owned_text}" if owned else text)


def _evict(stub: Any, args: argparse.Namespace) -> tuple[Any, str]:
    request = pb2.EvictRequest(shard=args.shard, tier=args.tier, bytes=args.bytes)
    reply = stub.Evict(request, timeout=args.timeout)
    text = (
        f"evicted {reply.blocks_evicted} blocks from {args.tier} of shard {args.shard}: "
        f"{human_bytes(reply.before.used_bytes)} -> {human_bytes(reply.after.used_bytes)} used "
        f"({reply.before.blocks} -> {reply.after.blocks} blocks)"
    )
    return to_plain(reply), text


COMMANDS: dict[str, Command] = {
    "nodes": _nodes,
    "shards": _shards,
    "tiers": _tiers,
    "replicas": _replicas,
    "hot": _hot,
    "stats": _stats,
    "evict": _evict,
}


# ----------------------------------------------------------------------------- wiring


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("kvdb", help="inspect and manage a server's kvdb (admin service)")
    add_server_flag(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_tls_flags(p, server=False)
    add_api_key_flag(p)
    # --json after the subcommand too; SUPPRESS keeps the sub-parser from resetting it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="kvdb_command", metavar="ACTION", required=True)
    sub.add_parser("nodes", parents=[common], help="nodes, health, blocks")
    sub.add_parser("shards", parents=[common], help="local shards and tier usage")
    tiers = sub.add_parser("tiers", parents=[common], help="per-tier counters")
    tiers.add_argument("--shard", default="", help="only this shard")
    replicas = sub.add_parser("replicas", parents=[common], help="who holds a block")
    replicas.add_argument("key", type=_key, help="block key, 32 hex characters")
    replicas.add_argument("--tenant", default="", help="only if it is this tenant's (admin)")
    hot = sub.add_parser("hot", parents=[common], help="most-read blocks")
    hot.add_argument("-n", type=_count, default=10, help=f"how many (1..{MAX_HOT})")
    hot.add_argument("--shard", default="", help="only this shard")
    hot.add_argument("--tenant", default="", help="only this tenant's blocks (admin)")
    stats = sub.add_parser("stats", parents=[common], help="put/get counters")
    stats.add_argument("--shard", default="", help="only this shard")
    stats.add_argument("--reset", action="store_true", help="zero the counters after reading")
    stats.add_argument("--tenant", default="", help="also what this tenant holds (admin)")
    evict = sub.add_parser("evict", parents=[common], help="evict bytes from a tier now")
    evict.add_argument("--shard", required=True, help="shard id (see `shards`)")
    evict.add_argument("--tier", required=True, choices=sorted(TIER_NAMES))
    evict.add_argument("--bytes", required=True, type=_size, help="e.g. 1048576, 64K, 1M")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = COMMANDS[args.kvdb_command]
    try:
        apply_tls(args)
    except ValueError as exc:
        print(f"kvflow kvdb: {exc}", file=sys.stderr)
        return 2
    try:
        opened = open_stub(args.server, pb2_grpc.KVAdminStub, args.api_key)
    except ValueError as exc:
        print(f"kvflow kvdb: --server: {exc}", file=sys.stderr)
        return 2
    with opened as stub:
        try:
            value, text = command(stub, args)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = code.name if code is not None else "UNKNOWN"
            details = exc.details() if hasattr(exc, "details") else str(exc)
            print(f"kvflow kvdb {args.kvdb_command}: {name}: {details}", file=sys.stderr)
            return 1
    print(json.dumps(value, indent=2) if args.json else text)
    return 0
