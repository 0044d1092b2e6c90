"""PNG plots and CSV files of `kvflow replay` results (matplotlib, Agg backend: no display).

Each function writes one file and returns its path; ``runs`` are ``(params, report)`` pairs in
sweep order, ``params`` the swept values of that run (policy, load, prefill, decode, cache).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from kvflow.router import SimulationReport

Run = tuple[dict[str, Any], SimulationReport]

OUTCOME_FIELDS = (
    "request_id", "arrival_s", "prompt_len", "output_len", "prefill_id", "decode_id",
    "reused_tokens", "local_hit_tokens", "pulled_blocks", "predicted_ttft_s", "ttft_s",
    "decode_wait_s", "tbt_s", "finish_s", "rejected",
)  # fmt: skip


def _label(params: dict[str, Any], keys: Sequence[str]) -> str:
    return " ".join(f"{k}={params[k]}" for k in keys) or "run"


def varying(runs: Sequence[Run]) -> list[str]:
    """The parameter names that take more than one value over ``runs``."""
    if not runs:
        return []
    return [k for k in runs[0][0] if len({str(p[k]) for p, _ in runs}) > 1]


def ttft_cdf(runs: Sequence[Run], path: Path) -> Path:
    """TTFT CDF of each run at the first value of every swept parameter except the policy."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = {k: v for k, v in runs[0][0].items() if k != "policy"}
    for params, report in runs:
        if any(params[k] != v for k, v in base.items()):
            continue
        ttft = np.sort([o.ttft_s for o in report.outcomes if o.rejected is None])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=params["policy"])
    if report.ttft_slo_s is not None:
        ax.axvline(report.ttft_slo_s, color="grey", linestyle="--", label="TTFT SLO")
    ax.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of served requests")
    ax.set_title("TTFT CDF " + _label(base, list(base)))
    ax.legend()
    return _save(fig, path)


def capacity_vs_load(runs: Sequence[Run], path: Path) -> Path:
    """Effective request capacity against the load multiplier, one line per other setting."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    others = [k for k in varying(runs) if k != "load"]
    lines: dict[str, list[tuple[float, float]]] = {}
    for params, report in runs:
        key = _label(params, others)
        lines.setdefault(key, []).append((float(params["load"]), report.effective_capacity))
    for key, points in lines.items():
        points.sort()
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=key)
    ax.set(xlabel="load (x trace rate)", ylabel="share of requests within both SLOs")
    ax.set_ylim(0, 1.05)
    ax.set_title("Effective request capacity vs load")
    ax.legend(fontsize="small")
    return _save(fig, path)


def hit_ratio_over_time(runs: Sequence[Run], path: Path, bins: int = 30) -> Path:
    """Local and pulled hit ratio of served requests over arrival time, for each policy at the
    first sweep point."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = {k: v for k, v in runs[0][0].items() if k != "policy"}
    for params, report in runs:
        if any(params[k] != v for k, v in base.items()):
            continue
        served = [o for o in report.outcomes if o.rejected is None]
        if not served:
            continue
        arrival = np.array([o.arrival_s for o in served])
        edges = np.linspace(0, max(arrival.max(), 1e-9), bins + 1)
        where = np.clip(np.digitize(arrival, edges) - 1, 0, bins - 1)
        prompt = np.bincount(where, [o.prompt_len for o in served], bins)
        local = np.bincount(where, [o.local_hit_tokens for o in served], bins)
        reused = np.bincount(where, [o.reused_tokens for o in served], bins)
        mid = (edges[:-1] + edges[1:]) / 2
        safe = np.maximum(prompt, 1)
        (line,) = ax.plot(mid, reused / safe, label=f"{params['policy']} total")
        ax.plot(mid, local / safe, linestyle=":", color=line.get_color(), label="  local")
    ax.set(xlabel="arrival time (s)", ylabel="hit ratio (prompt tokens)")
    ax.set_ylim(0, 1)
    ax.set_title("Cache hit ratio over time (dotted: local only)")
    ax.legend(fontsize="small")
    return _save(fig, path)


def per_instance_load(runs: Sequence[Run], path: Path) -> Path:
    """Requests per prefill instance for each policy at the first sweep point."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    base = {k: v for k, v in runs[0][0].items() if k != "policy"}
    chosen = [(p, r) for p, r in runs if all(p[k] == v for k, v in base.items())]
    width = 0.8 / max(1, len(chosen))
    for n, (params, report) in enumerate(chosen):
        loads = [i for i in report.instances if i.kind == "prefill"]
        x = np.arange(len(loads)) + n * width
        ax.bar(x, [i.requests for i in loads], width, label=params["policy"])
    ax.set(xlabel="prefill instance", ylabel="requests prefilled")
    ax.set_title("Per-instance load")
    ax.legend(fontsize="small")
    return _save(fig, path)


def write_plots(runs: Sequence[Run], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    return [
        ttft_cdf(runs, directory / "ttft_cdf.png"),
        capacity_vs_load(runs, directory / "capacity_vs_load.png"),
        hit_ratio_over_time(runs, directory / "hit_ratio_over_time.png"),
        per_instance_load(runs, directory / "per_instance_load.png"),
    ]


def write_requests_csv(runs: Sequence[Run], path: Path) -> Path:
    """One row per request per run: the run's parameters, then the outcome's fields."""
    keys = list(runs[0][0]) if runs else []
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow([*keys, *OUTCOME_FIELDS])
        for params, report in runs:
            for o in report.outcomes:
                writer.writerow(
                    [*(params[k] for k in keys), *(getattr(o, f) for f in OUTCOME_FIELDS)]
                )
    return path


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
