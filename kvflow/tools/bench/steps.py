"""Summarize an engine worker's step trace (``KVFLOW_STEP_TRACE``, runtime/step_trace.py).

Where a served workload's time went, step by step: wall time against the time inside engine
steps, the idle gaps between them, handing outputs on; the steps by kind (prompt tokens only,
decode only, both) with their mean wall time; the decode batch; the prompt tokens per step;
the engine thread's CPU share inside steps (below 1: preempted by other threads or
processes; a spinning OpenMP thread keeps it near 1 even while its partner waits for a core);
the cores this process and the other processes on the host used meanwhile (traces that
record them: a step is slower while other processes take the engine's cores); and, for a
colocated server, the lag from a request's prefill finishing (its first token) to its decode
being admitted (request ids ``<id>/prefill`` and ``<id>/decode``),
in seconds and in engine steps run meanwhile (steps the request sat out).
One summary line per trace (``--split-gap S``: per phase, a gap of at least S seconds between
steps starting the next, e.g. a benchmark's rows); ``--json PATH`` writes every number.

    KVFLOW_STEP_TRACE=/tmp/trace kvflow serve ...        # one file per worker
    python -m kvflow.tools.bench.steps /tmp/trace.*.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    """The trace's records, in order (a torn last line is skipped)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def phases(records: list[dict[str, Any]], split_gap: float | None) -> list[list[dict[str, Any]]]:
    """``records`` cut where a step began at least ``split_gap`` seconds after the previous
    one's outputs were handed on (None: one phase)."""
    cut: list[list[dict[str, Any]]] = []
    for r in records:
        if not cut or (split_gap is not None and r["gap"] >= split_gap):
            cut.append([])
        cut[-1].append(r)
    return cut


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def cores(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """The CPU cores in use while ``records`` ran (their steps and hand-ons): by this process
    (all its threads) and by other processes on the host; None for traces without them."""
    timed = [r for r in records if r.get("host_busy") is not None and "proc_cpu" in r]
    wall = sum(r["step"] + r["sink"] for r in timed)
    if not timed or wall <= 0:
        return {"process_cores": None, "other_cores": None}
    proc = sum(r["proc_cpu"] for r in timed)
    return {
        "process_cores": proc / wall,
        "other_cores": max(0.0, sum(r["host_busy"] for r in timed) - proc) / wall,
    }


def _kind(record: dict[str, Any]) -> str:
    return ("prefill" if record["prompt"] else "") + ("+decode" if record["decode"] else "")


def summarize(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The numbers of one worker's trace (see the module docstring)."""
    recs = list(records)
    if not recs:
        return {"steps": 0}
    end = recs[-1]["t"] + recs[-1]["step"] + recs[-1]["sink"]
    step_s = sum(r["step"] for r in recs)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by_kind.setdefault(_kind(r).lstrip("+") or "none", []).append(r)
    kinds = {
        k: {
            "steps": len(rs),
            "seconds": sum(r["step"] for r in rs),
            "mean_ms": 1000 * statistics.fmean(r["step"] for r in rs),
            "median_ms": 1000 * statistics.median(r["step"] for r in rs),
            "cpu_share": sum(r["cpu"] for r in rs) / max(1e-9, sum(r["step"] for r in rs)),
            **cores(rs),
        }
        for k, rs in by_kind.items()
    }
    batches = [r["decode"] for r in recs if r["decode"]]
    prompts = [sum(r["prompt"]) for r in recs if r["prompt"]]
    gaps = [r["gap"] for r in recs[1:]]
    finished: dict[str, tuple[int, float]] = {}
    lags: list[float] = []
    lag_steps: list[int] = []  # steps run between the prefill's last and the decode's first
    for i, r in enumerate(recs):
        for rid, at in r["admitted"]:
            base, _, role = rid.rpartition("/")
            if role == "decode" and base in finished:
                step, ended = finished.pop(base)
                lags.append(at - ended)
                lag_steps.append(i - step - 1)
        for rid in r["finished"]:
            base, _, role = rid.rpartition("/")
            if role == "prefill":
                finished[base] = (i, r["t"] + r["step"])
    return {
        "steps": len(recs),
        "wall_s": end - recs[0]["t"],
        "in_steps_s": step_s,
        "gaps_s": sum(gaps),
        "gap_p99_s": _quantile(gaps, 0.99),
        "sink_s": sum(r["sink"] for r in recs),
        "cpu_share": sum(r["cpu"] for r in recs) / step_s if step_s > 0 else 0.0,
        **cores(recs),
        "kinds": kinds,
        "prompt_tokens": sum(prompts),
        "prompt_per_step_mean": statistics.fmean(prompts) if prompts else 0.0,
        "decode_rows": sum(batches),
        "decode_batch_mean": statistics.fmean(batches) if batches else 0.0,
        "tokens": sum(r["tokens"] for r in recs),
        "prefill_to_decode_lag_p50_s": _quantile(lags, 0.5) if lags else None,
        "prefill_to_decode_lag_p90_s": _quantile(lags, 0.9) if lags else None,
        "prefill_to_decode_lag_steps_mean": statistics.fmean(lag_steps) if lag_steps else None,
        "handoffs": len(lags),
    }


def line(name: str, s: dict[str, Any]) -> str:
    if not s["steps"]:
        return f"bench steps {name}: no steps"
    kinds = ", ".join(
        f"{k} {int(v['steps'])}x{v['median_ms']:.0f}ms" for k, v in sorted(s["kinds"].items())
    )
    lag = s["prefill_to_decode_lag_p50_s"]
    lag_text = (
        ""
        if lag is None
        else f", prefill->decode lag p50 {lag:.3f}s, "
        f"{s['prefill_to_decode_lag_steps_mean']:.2f} steps"
    )
    used = (
        ""
        if s.get("process_cores") is None
        else f", cores: this process {s['process_cores']:.2f}, others {s['other_cores']:.2f}"
    )
    return (
        f"bench steps {name}: {s['steps']} steps, wall {s['wall_s']:.1f}s = steps "
        f"{s['in_steps_s']:.1f}s + gaps {s['gaps_s']:.2f}s + sinks {s['sink_s']:.2f}s; "
        f"cpu share {s['cpu_share']:.2f}{used}; {kinds}; prompt {s['prompt_tokens']} tok "
        f"({s['prompt_per_step_mean']:.0f}/step), decode batch {s['decode_batch_mean']:.1f}, "
        f"{s['tokens']} tokens{lag_text}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvflow.tools.bench.steps", description=__doc__)
    p.add_argument("traces", nargs="+", type=Path, help="KVFLOW_STEP_TRACE files (.jsonl)")
    p.add_argument(
        "--split-gap", type=float, help="a gap of at least this many seconds starts a phase"
    )
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args(argv)
    doc: dict[str, list[dict[str, Any]]] = {}
    for path in args.traces:
        doc[str(path)] = []
        for i, phase in enumerate(phases(load(path), args.split_gap)):
            doc[str(path)].append(summarize(phase))
            print(line(f"{path.name}#{i}", doc[str(path)][-1]))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
