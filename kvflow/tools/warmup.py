"""`kvflow warmup submit|status|list|cancel|report`: offline cache warm-up jobs on a running
server (the embedded server or a router), over the Warmup gRPC service.

``submit`` reads the corpus files here (a directory: every file under it) and sends them; the
server parses them (malformed lines come back with their line numbers), renders chats with the
model's template and runs the job at background priority. Without ``--no-wait`` it shows a
progress bar with an ETA until the job ends. ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from kvflow.grpc_proto import load_proto
from kvflow.tools.args import add_tls_flags, apply_tls
from kvflow.tools.caller import add_api_key_flag, add_server_flag, open_stub

FINAL = ("done", "cancelled", "failed")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("warmup", help="offline cache warm-up jobs (submit, status, ...)")
    add_server_flag(p)
    add_tls_flags(p, server=False)
    add_api_key_flag(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser(
        "submit", help="warm a corpus (JSONL prompts/chats/batch lines, text, trace)"
    )
    s.add_argument("paths", nargs="+", help="corpus files or directories")
    s.add_argument(
        "--format",
        default="auto",
        choices=["auto", "prompts", "chat", "openai-batch", "trace", "text"],
    )
    s.add_argument("--tenant", default="")
    s.add_argument("--max-blocks", type=int, default=0, help="budget: new blocks (0: no limit)")
    s.add_argument("--max-bytes", type=int, default=0, help="budget: new bytes (0: no limit)")
    s.add_argument("--on-limit", default="stop", choices=["stop", "skip", "truncate"])
    s.add_argument("--replicas", type=int, default=0, help="replica target of warmed blocks")
    s.add_argument("--pin-ttl", type=float, default=0.0, help="pin warmed blocks for S seconds")
    s.add_argument("--segment-blocks", type=int, default=0, help="blocks per background step")
    s.add_argument("--dry-run", action="store_true", help="estimate without computing")
    s.add_argument("--no-wait", action="store_true", help="return once the job is queued")
    for name in ("status", "cancel", "report"):
        q = sub.add_parser(name, help=f"{name} of one job")
        q.add_argument("job_id")
        if name == "status":
            q.add_argument("--watch", action="store_true", help="progress bar until it ends")
    sub.add_parser("list", help="every job this server knows")
    p.set_defaults(func=run)


def _proto() -> tuple[Any, Any]:
    return load_proto("kvflow/stages/api/warmup.proto")


def read_corpus(paths: list[str]) -> list[tuple[str, bytes]]:
    """(name, bytes) of every file named or under a named directory, sorted."""
    out = []
    for raw in paths:
        path = Path(raw)
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        out += [(str(f), f.read_bytes()) for f in files]
    return out


def run(args: argparse.Namespace) -> int:
    pb2, pb2_grpc = _proto()
    try:
        apply_tls(args)
    except ValueError as exc:
        print(f"kvflow warmup: {exc}", file=sys.stderr)
        return 2
    try:
        opened = open_stub(args.server, pb2_grpc.WarmupStub, args.api_key)
    except ValueError as exc:
        print(f"kvflow warmup: --server: {exc}", file=sys.stderr)
        return 2
    with opened as stub:
        try:
            return _ACTIONS[args.action](args, stub, pb2)
        except grpc.RpcError as err:
            print(
                f"kvflow warmup {args.action}: {err.code().name}: {err.details()}", file=sys.stderr
            )
            return 1
        except OSError as exc:
            print(f"kvflow warmup {args.action}: {exc}", file=sys.stderr)
            return 2


def _dict(msg: Any) -> dict[str, Any]:
    """Every field of ``msg`` (defaults included), numbers as JSON numbers (MessageToDict
    would print 64-bit integers as strings)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(value)
        elif field.message_type is not None:
            is_list = field.is_repeated
            out[field.name] = [_dict(v) for v in value] if is_list else _dict(value)
        elif field.is_repeated:
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def _submit(args: argparse.Namespace, stub: Any, pb2: Any) -> int:
    files = [pb2.CorpusFile(name=n, content=c) for n, c in read_corpus(args.paths)]
    options = pb2.JobOptions(
        tenant=args.tenant,
        format=args.format,
        budget=pb2.Budget(
            max_blocks=args.max_blocks, max_bytes=args.max_bytes, on_limit=args.on_limit
        ),
        replicas=args.replicas,
        pin_ttl_s=args.pin_ttl,
        segment_blocks=args.segment_blocks,
    )
    reply = stub.Submit(
        pb2.SubmitRequest(files=files, options=options, dry_run=args.dry_run), timeout=300
    )
    if not args.json:
        for line in reply.corpus_errors:
            print(f"skipped {line}", file=sys.stderr)
    if args.dry_run:
        if args.json:
            print(
                json.dumps(
                    {"estimate": _dict(reply.estimate), "corpus_errors": list(reply.corpus_errors)}
                )
            )
        else:
            _print_estimate(reply.estimate)
        return 0
    job = reply.job
    if args.no_wait:
        print(json.dumps(_dict(job)) if args.json else f"job {job.job_id} queued")
        return 0
    status = _watch(stub, pb2, job.job_id, quiet=args.json)
    print(json.dumps(_dict(status)) if args.json else _summary(status))
    return 0 if status.state == "done" else 1


def _print_estimate(e: Any) -> None:
    print(
        f"dry run: {e.items_ok}/{e.items} items, {e.blocks_to_compute} blocks to compute "
        f"({e.bytes_to_compute / 2**20:.1f} MiB, {e.tokens_to_compute} tokens), "
        f"{e.blocks_cached} of {e.blocks_total} blocks already cached, "
        f"predicted prefill {e.predicted_prefill_s:.2f} s"
        + (", the budget stops it" if e.budget_stops else "")
        + (f", {e.items_over_budget} items over budget" if e.items_over_budget else "")
    )
    for line in e.item_errors:
        print(f"  {line}")


def _watch(stub: Any, pb2: Any, job_id: str, quiet: bool) -> Any:
    """Poll until the job ends; a rich progress bar (items, ETA) unless ``quiet``."""
    req = pb2.JobRequest(job_id=job_id)
    if quiet:
        while (status := stub.Status(req, timeout=30)).state not in FINAL:
            time.sleep(0.2)
        return status
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("[bold]warm-up {task.fields[job]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[blocks]} blocks"),
        TimeRemainingColumn(),
    ) as bar:
        status = stub.Status(req, timeout=30)
        task = bar.add_task("", total=status.items_total, job=job_id, blocks=0)
        while True:
            bar.update(task, completed=status.items_finished, blocks=status.blocks_warmed)
            if status.state in FINAL:
                return status
            time.sleep(0.2)
            status = stub.Status(req, timeout=30)


def _summary(s: Any) -> str:
    states = ", ".join(f"{k} {v}" for k, v in sorted(s.items_by_state.items()))
    eta = f", ETA {s.eta_s:.0f} s" if s.state == "running" and s.eta_s >= 0 else ""
    lines = [
        f"job {s.job_id} {s.state}{' (' + s.stopped_reason + ')' if s.stopped_reason else ''}: "
        f"{s.items_finished}/{s.items_total} items ({states}), {s.blocks_warmed} blocks, "
        f"{s.bytes_warmed / 2**20:.1f} MiB, {s.tokens_prefilled} tokens{eta}"
    ]
    lines += [f"  {e}" for e in s.errors]
    return "\n".join(lines)


def _status(args: argparse.Namespace, stub: Any, pb2: Any) -> int:
    if args.watch:
        status = _watch(stub, pb2, args.job_id, quiet=args.json)
    else:
        status = stub.Status(pb2.JobRequest(job_id=args.job_id), timeout=30)
    print(json.dumps(_dict(status)) if args.json else _summary(status))
    return 0


def _list(args: argparse.Namespace, stub: Any, pb2: Any) -> int:
    jobs = stub.List(pb2.ListRequest(), timeout=30).jobs
    if args.json:
        print(json.dumps({"jobs": [_dict(j) for j in jobs]}))
    else:
        for j in jobs:
            print(
                f"{j.job_id}  {j.state:9}  {j.items_finished}/{j.items_total} items  "
                f"{j.blocks_warmed} blocks  tenant {j.tenant}"
            )
    return 0


def _cancel(args: argparse.Namespace, stub: Any, pb2: Any) -> int:
    status = stub.Cancel(pb2.JobRequest(job_id=args.job_id), timeout=30)
    print(json.dumps(_dict(status)) if args.json else _summary(status))
    return 0


def _report(args: argparse.Namespace, stub: Any, pb2: Any) -> int:
    rep = stub.Report(pb2.JobRequest(job_id=args.job_id), timeout=300)
    if args.json:
        print(json.dumps(_dict(rep)))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"warm-up job {rep.job_id}: coverage")
    for col in ("item", "label", "blocks", "tiers", "holders", "replicas", "note"):
        table.add_column(col)
    for r in rep.items:
        tiers = " ".join(f"{k}:{v}" for k, v in sorted(r.tiers.items()))
        reps = f"{r.min_replicas}-{r.max_replicas} (target {r.replica_target})"
        table.add_row(
            str(r.index),
            r.label[:40],
            f"{r.blocks_cached}/{r.blocks_total}",
            tiers,
            ",".join(r.holders),
            reps,
            r.error,
        )
    Console().print(table)
    t = rep.totals
    print(
        f"totals: {t.items_covered}/{t.items} items fully cached, {t.blocks_cached}/"
        f"{t.blocks_total} blocks, {t.bytes_cached / 2**20:.1f} MiB, {t.tokens_cached} tokens; "
        f"predicted prefill saved {t.prefill_s_saved:.2f} s of {t.prefill_s_cold:.2f} s cold"
    )
    return 0


_ACTIONS = {
    "submit": _submit,
    "status": _status,
    "list": _list,
    "cancel": _cancel,
    "report": _report,
}
