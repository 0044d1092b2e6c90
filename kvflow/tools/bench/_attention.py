"""What the attention kernel benchmarks (`prefill_attention`, `decode_attention`) share: the
flags for the model's attention shapes, the settings compared and the run's options, and the
report (the one summary line, the JSON)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvflow.stages.engine.cpu_attn import ATTN_SETTINGS
from kvflow.tools.bench import _cli
from kvflow.tools.bench._meta import run_meta


def add_shape_arguments(p: argparse.ArgumentParser, rounds: int) -> argparse.ArgumentParser:
    """The default model's attention shapes (30 layers, 9 query heads on 3 KV heads, head dim
    64, pages of 64), the threads, `--rounds` (default ``rounds``), the settings, the seed
    and `--json`."""
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9, help="query heads")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=64, help="tokens a page")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--rounds", type=int, default=rounds, help="alternating rounds (best of)")
    p.add_argument(
        "--attention",
        type=_cli.names_of("attention setting", ATTN_SETTINGS),
        default=list(ATTN_SETTINGS),
        help="settings, comma-separated: paged, torch (both by default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write full results here")
    return p


def report(args: argparse.Namespace, line: str, results: dict) -> int:
    """Print the summary ``line``; with `--json`, write it, the run's metadata and
    ``results``."""
    print(line)
    if args.json:
        payload = {"summary": line, "meta": run_meta(args), "results": results}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0
