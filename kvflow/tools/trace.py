"""`kvflow trace export|report`: per-stage spans of a running server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import grpc

from kvflow.stages.api import pb2, pb2_grpc
from kvflow.tools.caller import add_api_key_flag, open_stub
from kvflow.tools.trace_report import report_file


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("trace", help="export or summarise stage traces")
    sub = p.add_subparsers(dest="trace_command", required=True)
    exp = sub.add_parser("export", help="write a Chrome/Perfetto trace file from a server")
    exp.add_argument("--server", default="127.0.0.1:50051")
    exp.add_argument("--out", type=Path, required=True)
    exp.add_argument("--last", type=int, default=0, help="only the last N requests")
    add_api_key_flag(exp)  # a user key exports only its tenant's requests
    exp.set_defaults(func=run_export)
    rep = sub.add_parser("report", help="per-stage latency breakdown (p50/p90/p99)")
    src = rep.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", type=Path, help="a trace file written by `trace export`")
    src.add_argument("--server", help="HOST:PORT: fetch the traces first")
    rep.add_argument("--children", action="store_true", help="include child spans")
    add_api_key_flag(rep)
    rep.set_defaults(func=run_report)


def fetch(server: str, last: int, api_key: str | None = None) -> bytes:
    with open_stub(server, pb2_grpc.InferenceStub, api_key) as stub:
        reply = stub.ExportTrace(pb2.ExportTraceRequest(last_n=last), timeout=30)
    return bytes(reply.chrome_trace_json)


def run_export(args: argparse.Namespace) -> int:
    try:
        data = fetch(args.server, args.last, args.api_key)
    except grpc.RpcError as err:
        print(f"kvflow trace export: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"kvflow trace export: --server: {exc}", file=sys.stderr)
        return 2
    args.out.write_bytes(data)
    print(f"wrote {len(data)} bytes to {args.out} (open it in https://ui.perfetto.dev)")
    return 0


def run_report(args: argparse.Namespace) -> int:
    path: Path = args.file
    if args.server:
        import tempfile

        try:
            data = fetch(args.server, 0, args.api_key)
        except grpc.RpcError as err:
            print(f"kvflow trace report: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
        except ValueError as exc:
            print(f"kvflow trace report: --server: {exc}", file=sys.stderr)
            return 2
        with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
            f.write(data)
            path = Path(f.name)
    try:
        print(report_file(path, include_children=args.children))
    except (OSError, ValueError) as exc:
        print(f"kvflow trace report: {exc}", file=sys.stderr)
        return 2
    return 0
