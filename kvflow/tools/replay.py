"""`kvflow replay`: route a Mooncake trace through the simulated cluster; capacity planning.

One run per combination of the swept values (``--policy``/``--all-policies``, ``--load``,
``--prefill``, ``--decode``, ``--cache-blocks``: each takes a comma-separated list). Prints one
table row per run (effective capacity, TTFT/TBT percentiles, rejections, hit ratio split into
local and pulled); ``--json`` prints the full reports as JSON instead, ``--json PATH`` writes them
to PATH as well. ``--plots DIR`` writes PNG plots, ``--requests-csv PATH`` every request of every
run. A progress bar (rich) runs on stderr when it is a terminal, or with ``--progress``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvflow.router import SimulationConfig, SimulationReport, policy_names, read_trace, simulate
from kvflow.router.sim_presets import DEFAULT_PRESET, make_preset, preset_from_profile, preset_names
from kvflow.router.trace import TRACE_BLOCK_SIZE

HEADER = (
    f"{'policy':<18} {'load':>5} {'P':>3} {'D':>3} {'served':>6} {'reject%':>7} {'cap%':>6} "
    f"{'ttft_p50':>8} {'ttft_p99':>8} {'tbt_p50':>7} {'tbt_p99':>7} {'hit%':>5} {'local%':>6} "
    f"{'pull%':>5}"
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay", help="replay a request trace through the router's simulator (capacity planning)"
    )
    add = parser.add_argument
    add("--trace", required=True, type=Path, help="Mooncake-format JSONL trace")
    add("--prefill", type=_ints, default=[8], help="prefill instances (list sweeps)")
    add("--decode", type=_ints, default=[4], help="decode instances (list sweeps)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--policy", default="cache-aware", help=f"one or more of {policy_names()}")
    group.add_argument("--all-policies", action="store_true", help="run every policy")
    add("--load", type=_floats, default=[1.0], help="load multipliers: 2 = arrivals twice as fast")
    add("--start", type=int, default=0, help="first record to replay")
    add("--limit", type=int, default=None, help="records to replay")
    add("--seed", type=int, default=0)
    add("--preset", default=DEFAULT_PRESET, choices=preset_names(), help="cost model (derived)")
    add("--profile", type=Path, default=None, help="model dir with kvflow_profile.json")
    add("--kv-bytes-per-token", type=int, default=None, help="with --profile: KV bytes/token")
    add("--block-size", type=int, default=TRACE_BLOCK_SIZE, help="tokens per trace hash id")
    add(
        "--cache-blocks",
        type=_ints,
        default=[10_000],
        help="prefix cache per prefill instance, in BLOCKS of --block-size tokens; 0 = unbounded",
    )
    add(
        "--decode-memory",
        type=int,
        default=None,
        help="KV memory per decode instance in TOKENS (default: the preset's; 0 = unbounded)",
    )
    add("--chunk-tokens", type=int, default=8192, help="prefill chunk per request per step")
    add("--batch-tokens", type=int, default=16384, help="new tokens per prefill step")
    add("--threshold", type=float, default=2.0, help="kvcache balancing ratio")
    add("--ttft-slo", type=float, default=None, help="seconds; default none")
    add("--tbt-slo", type=float, default=None, help="seconds; default none")
    add("--no-admission", action="store_true", help="judge the SLOs but never reject")
    add("--bandwidth", type=float, default=25e9, help="BYTES/s of each holder's outbound link")
    add("--latency", type=float, default=1e-3, help="seconds per pull (link latency)")
    add("--plots", type=Path, default=None, metavar="DIR", help="write PNG plots to DIR")
    add("--requests-csv", type=Path, default=None, metavar="PATH", help="per-request CSV")
    add("--progress", action="store_true", help="progress bar even when stderr is no terminal")
    add(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="print full JSON reports (no PATH) or also write them to PATH",
    )
    parser.set_defaults(func=run)


def _base_config(args: argparse.Namespace) -> SimulationConfig:
    if args.profile is not None:
        kv = args.kv_bytes_per_token or make_preset(args.preset).kv_bytes_per_token
        capacity = args.decode_memory or make_preset(args.preset).decode_capacity_tokens
        preset = preset_from_profile(args.profile, kv, capacity)
    else:
        preset = make_preset(args.preset)
    fields: dict[str, Any] = {
        "bandwidth_bytes_per_s": args.bandwidth,
        "transfer_latency_s": args.latency,
        "prefill_chunk_tokens": args.chunk_tokens,
        "prefill_batch_tokens": args.batch_tokens,
        "ttft_slo_s": args.ttft_slo,
        "tbt_slo_s": args.tbt_slo,
    }
    if args.decode_memory is not None:
        fields["decode_capacity_tokens"] = args.decode_memory or None
    base = SimulationConfig.from_preset(preset, args.block_size, **fields)
    router = replace(
        base.router,
        seed=args.seed,
        balancing_threshold=args.threshold,
        ttft_slo_s=None if args.no_admission else args.ttft_slo,
        tbt_slo_s=None if args.no_admission else args.tbt_slo,
    )
    return replace(base, router=router)


def sweep(args: argparse.Namespace) -> list[tuple[dict[str, Any], SimulationConfig]]:
    """Every (params, config) of the sweep, in order. ValueError on a bad value."""
    base = _base_config(args)
    policies = policy_names() if args.all_policies else tuple(args.policy.split(","))
    runs = []
    for policy, load, prefill, decode, cache in itertools.product(
        policies, args.load, args.prefill, args.decode, args.cache_blocks
    ):
        if load <= 0:
            raise ValueError(f"load must be > 0, got {load}")
        params = {"policy": policy, "load": load, "prefill": prefill, "decode": decode,
                  "cache": cache}  # fmt: skip
        config = replace(
            base,
            num_prefill=prefill,
            num_decode=decode,
            cache_capacity_blocks=cache or None,
            time_scale=1.0 / load,
            router=replace(base.router, policy=policy),
        )
        runs.append((params, config))
    return runs


def _row(params: dict[str, Any], r: SimulationReport) -> str:
    return (
        f"{r.policy:<18} {params['load']:>5g} {params['prefill']:>3} {params['decode']:>3} "
        f"{r.served:>6} {100 * r.rejection_rate:>7.1f} {100 * r.effective_capacity:>6.1f} "
        f"{r.ttft_p50_s:>8.3f} {r.ttft_p99_s:>8.3f} {r.tbt_p50_s:>7.4f} {r.tbt_p99_s:>7.4f} "
        f"{100 * r.cache_hit_ratio:>5.1f} {100 * r.local_hit_ratio:>6.1f} "
        f"{100 * r.pulled_hit_ratio:>5.1f}"
    )


def _simulate_all(
    planned: list[tuple[dict[str, Any], SimulationConfig]], records: list[Any], show: bool
) -> list[tuple[dict[str, Any], SimulationReport]]:
    if not show:
        return [(p, simulate(c, records)) for p, c in planned]
    from rich.progress import Progress  # only tools/ draws

    out = []
    with Progress(transient=True) as bar:
        task = bar.add_task("replay", total=len(planned) * max(1, len(records)))
        for n, (params, config) in enumerate(planned):
            done = n * len(records)
            bar.update(task, description=f"{params['policy']} load={params['load']}")
            report = simulate(
                config, records, lambda i, _t, d=done: bar.update(task, completed=d + i)
            )
            out.append((params, report))
    return out


def run(args: argparse.Namespace) -> int:
    try:
        records = read_trace(args.trace, start=args.start, limit=args.limit)
        planned = sweep(args)
    except (OSError, ValueError) as exc:
        print(f"kvflow replay: {exc}", file=sys.stderr)
        return 2
    show = args.progress or sys.stderr.isatty()
    runs = _simulate_all(planned, records, show)
    document = {
        "trace": str(args.trace),
        "start": args.start,
        "records": len(records),
        "seed": args.seed,
        "cost_source": planned[0][1].cost_source if planned else "",
        "runs": [{"params": p, "report": r.to_dict()} for p, r in runs],
        "reports": [r.to_dict() for _, r in runs],
    }
    if args.plots is not None or args.requests_csv is not None:
        from kvflow.tools import replay_plots

        if args.plots is not None:
            for path in replay_plots.write_plots(runs, args.plots):
                print(f"wrote {path}", file=sys.stderr)
        if args.requests_csv is not None:
            replay_plots.write_requests_csv(runs, args.requests_csv)
            print(f"wrote {args.requests_csv}", file=sys.stderr)
    if args.json == "-":
        print(json.dumps(document, indent=2))
        return 0
    if args.json is not None:
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    counts = f"{','.join(map(str, args.prefill))} prefill + {','.join(map(str, args.decode))}"
    print(f"{len(records)} requests, {counts} decode instances; costs: {document['cost_source']}")
    print(HEADER)
    for params, report in runs:
        print(_row(params, report))
    return 0
