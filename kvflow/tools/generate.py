"""`kvflow generate`: send one prompt to a running server and print the answer."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import grpc

from kvflow.security.tls import unavailable_hint
from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient, parse_servers
from kvflow.tools.args import add_tls_flags, apply_tls
from kvflow.tools.caller import RETRY_FOR_S, add_api_key_flag, add_server_flag


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="send a prompt to a kvflow server")
    add_server_flag(p)
    add_api_key_flag(p)
    p.add_argument("--prompt", help="prompt text (or use --prompt-file / --token-ids)")
    p.add_argument("--prompt-file", help="read the prompt text from this file")
    p.add_argument("--token-ids", help="comma-separated token ids instead of text")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tenant", default="")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_tls_flags(p, server=False)
    p.set_defaults(func=run)


def build_request(args: argparse.Namespace) -> Any:
    sampling = pb2.SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        ignore_eos=args.ignore_eos,
    )
    if args.seed is not None:
        sampling.seed = args.seed
    req = pb2.GenerateRequest(tenant=args.tenant, max_tokens=args.max_tokens, sampling=sampling)
    sources = [x is not None for x in (args.prompt, args.prompt_file, args.token_ids)]
    if sum(sources) != 1:
        raise SystemExit(
            "kvflow generate: give exactly one of --prompt, --prompt-file, --token-ids"
        )
    if args.token_ids is not None:
        try:
            ids = [int(x) for x in args.token_ids.split(",") if x.strip()]
        except ValueError as exc:
            raise SystemExit(f"kvflow generate: --token-ids: {exc}") from exc
        req.token_ids.ids.extend(ids)
    elif args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            req.prompt = f.read()
    else:
        req.prompt = args.prompt
    return req


def usage_dict(usage: Any) -> dict[str, Any]:
    return {
        "request_id": usage.request_id,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
        "cached_by_tier": {t.tier: t.tokens for t in usage.cached_by_tier},
        "pulled_tokens": usage.pulled_tokens,
        "ttft_ms": usage.ttft_ms,
        "predicted_ttft_ms": usage.predicted_ttft_ms,
        "mean_tbt_ms": usage.mean_tbt_ms,
        "e2e_ms": usage.e2e_ms,
        "prefill_instance": usage.prefill_instance,
        "decode_instance": usage.decode_instance,
    }


def run(args: argparse.Namespace) -> int:
    req = build_request(args)
    token_ids: list[int] = []
    text_parts: list[str] = []
    finish_reason = ""
    usage: Any = None
    started = time.perf_counter()
    try:
        servers = parse_servers(args.server)
    except ValueError as exc:
        raise SystemExit(f"kvflow generate: --server: {exc}") from exc
    try:
        apply_tls(args)
    except ValueError as exc:
        raise SystemExit(f"kvflow generate: {exc}") from exc
    with InferenceClient(servers, retry_for_s=RETRY_FOR_S, api_key=args.api_key) as client:
        try:
            for msg in client.generate(req, timeout=args.timeout):
                token_ids.extend(msg.token_ids)
                text_parts.append(msg.text)
                if not args.json and msg.text:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
                if msg.finished:
                    finish_reason = msg.finish_reason
                    usage = msg.usage
        except grpc.RpcError as err:
            code = err.code().name if err.code() else "UNKNOWN"
            hint = unavailable_hint() if err.code() == grpc.StatusCode.UNAVAILABLE else ""
            print(f"kvflow generate: {code}: {err.details()}{hint}", file=sys.stderr)
            return 1
        except TimeoutError as exc:
            print(f"kvflow generate: {exc}", file=sys.stderr)
            return 1
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    result: dict[str, Any] = {
        "text": "".join(text_parts),
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "client_elapsed_ms": round(elapsed_ms, 3),
    }
    if usage is not None:
        result.update(usage_dict(usage))
    if args.json:
        print(json.dumps(result))
    else:
        print()
        print(
            f"[{result.get('prompt_tokens', 0)} prompt tokens, "
            f"{result.get('cached_tokens', 0)} cached {result.get('cached_by_tier', {})}, "
            f"{len(token_ids)} generated, TTFT {result.get('ttft_ms', 0.0):.1f} ms, "
            f"prefill={result.get('prefill_instance', '')} "
            f"decode={result.get('decode_instance', '')}]",
            file=sys.stderr,
        )
    return 0
