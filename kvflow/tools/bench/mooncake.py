"""`bench_mooncake`: kvflow's Mooncake-compatible API against the real Mooncake Store, side by
side, through the same Mooncake-style calls, in one run, on 127.0.0.1 only.

Per value size (64 KiB, 1 MiB, 4 MiB by default; ``--working-set-mib`` of seeded random
values per size, more than the L3 cache):

- put: ``batch_put_from`` of every value out of a registered source array into a store of
  this process (one pass per system, before any read);
- local: ``batch_get_into`` of every value, held by a store of this process, into distinct
  slices of one registered destination array; beside it the baseline, a numpy copy of every
  value from the source array into the same distinct slices ("memcpy");
- remote: a holder process per system (spawned) puts the same values into its own store; a
  reader store in this process that contributes no memory (Mooncake: a 0-byte segment;
  kvflow: a member that does not hold the keys) ``batch_get_into``s them into a registered
  array. Mooncake reads over TCP on loopback; kvflow, its holder being on this host, maps
  the holder's DRAM pool (same-host shm, its default), and a second kvflow reader
  ("kvflow-tcp", ``kvflow_same_host_shm`` False) reads over TCP on loopback as it would
  from another host.

Reads run in rounds: each round times every contender once, back to back, so both see the
same background load; the first round is dropped; reported are the medians of ``--repeat``
rounds (GB/s) and the median of the per-round ratios. Every read is checked byte for byte.

Mooncake is optional (PyPI ``mooncake-transfer-engine-non-cuda``, see ``INSTALL_HINT``):
without it, or with ``--skip-mooncake``, its columns are skipped with a message. Prints one
summary line; ``--json PATH`` writes everything (and the load average before and after).

    .venv/bin/python -m kvflow.tools.bench.mooncake --repeat 7 --json bench_mooncake.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.tools.bench import mooncake_stores as stores
from kvflow.tools.bench._net import stop_server_process

HOLDER_READY_S = 300.0
TCP_READER = "kvflow-tcp"
"""kvflow's second remote reader: over TCP although the holder is on this host."""


def parse_size(text: str) -> int:
    """'64KiB' / '1MiB' / '4096' -> bytes."""
    for suffix, shift in (("KiB", 10), ("MiB", 20)):
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) << shift
    return int(text)


def label(size: int) -> str:
    if size >= 1 << 20 and size % (1 << 20) == 0:
        return f"{size >> 20}MiB"
    return f"{size >> 10}KiB" if size % 1024 == 0 else f"{size}B"


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _rounds(fns: dict[str, Callable[[], None]], nbytes: int, repeat: int) -> dict[str, Any]:
    """Time every fn once per round, ``repeat + 1`` rounds, the first dropped."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            runs[name].append(_gbps(nbytes, time.perf_counter() - start))
    return {name: {"gbps": statistics.median(r[1:]), "runs": r[1:]} for name, r in runs.items()}


def _per_round(out: dict[str, Any], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(out[a]["runs"], out[b]["runs"], strict=True))


class _Reader:
    """``batch_get_into`` of keys into distinct slices of one registered array, checked."""

    def __init__(self, store: Any, keys: list[str], size: int, dst: np.ndarray) -> None:
        self.store, self.keys, self.size, self.dst = store, keys, size, dst
        if store.register_buffer(dst.ctypes.data, dst.nbytes) != 0:
            raise RuntimeError("register_buffer failed")
        self.ptrs = [dst.ctypes.data + i * size for i in range(len(keys))]
        self.sizes = [size] * len(keys)

    def __call__(self) -> None:
        got = self.store.batch_get_into(self.keys, self.ptrs, self.sizes)
        bad = [c for c in got if c != self.size]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(got)} reads failed (first: {bad[0]})")

    def close(self) -> None:
        self.store.unregister_buffer(self.dst.ctypes.data)


def _check(dst: np.ndarray, values: np.ndarray, what: str) -> None:
    if not np.array_equal(dst, values):
        raise RuntimeError(f"{what}: the bytes read differ from the values put")


def run_local(
    systems: Sequence[str],
    control: stores.Control,
    sizes: Sequence[int],
    counts: list[int],
    repeat: int,
    seed: int,
) -> list[dict[str, Any]]:
    """Put and local batch_get_into per size, every system's store in this process."""
    total = sum(s * c for s, c in zip(sizes, counts, strict=True))
    opened = {name: stores.open_store(name, control, total + (64 << 20)) for name in systems}
    results = []
    try:
        for size, count in zip(sizes, counts, strict=True):
            values = stores.values_for(size, count, seed)
            entry: dict[str, Any] = {"size": size, "count": count, "put": {}}
            readers: dict[str, _Reader] = {}
            dsts = {}
            for name, store in opened.items():
                if store.register_buffer(values.ctypes.data, values.nbytes) != 0:
                    raise RuntimeError(f"{name}: register_buffer failed")
                keys = stores.object_keys("local", size, count)
                seconds = stores.put_all(store, keys, values, size)
                entry["put"][name] = {"gbps": _gbps(values.nbytes, seconds), "seconds": seconds}
                dsts[name] = np.zeros_like(values)  # faulted in before timing
                readers[name] = _Reader(store, keys, size, dsts[name])
            memcpy_dst = np.zeros_like(values)
            pairs = [
                (memcpy_dst[i * size : (i + 1) * size], values[i * size : (i + 1) * size])
                for i in range(count)
            ]

            def memcpy(pairs: list[tuple[np.ndarray, np.ndarray]] = pairs) -> None:
                for dst, src in pairs:
                    np.copyto(dst, src)

            entry["get"] = _rounds({"memcpy": memcpy, **readers}, values.nbytes, repeat)
            for name in (*systems, "memcpy"):
                _check(memcpy_dst if name == "memcpy" else dsts[name], values, f"local {name}")
            entry["ratios"] = _ratios(entry["get"], systems, "memcpy")
            results.append(entry)
            for name, store in opened.items():
                readers[name].close()
                store.unregister_buffer(values.ctypes.data)
            del readers, dsts, pairs
    finally:
        for store in opened.values():
            store.close()
    return results


def _ratios(runs: dict[str, Any], systems: Sequence[str], base: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    if base is not None:
        for name in systems:
            out[f"{name}/{base}"] = _per_round(runs, name, base)
    if "mooncake" in systems:
        out["kvflow/mooncake"] = _per_round(runs, "kvflow", "mooncake")
    return out


def _await_visible(store: Any, keys: list[str], what: str) -> None:
    """Wait until the reader sees every key (kvflow's metadata is written asynchronously)."""
    deadline = time.monotonic() + 30.0
    while any(c != 1 for c in store.batch_is_exist(keys)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: the holder's keys did not become visible in 30 s")
        time.sleep(0.05)


def run_remote(
    systems: Sequence[str],
    control: stores.Control,
    sizes: Sequence[int],
    counts: list[int],
    repeat: int,
    seed: int,
) -> list[dict[str, Any]]:
    """Two processes per system: a spawned holder puts, a reader store here reads."""
    context = multiprocessing.get_context("spawn")
    holders = []
    readers: dict[str, Any] = {}
    try:
        for name in systems:
            parent, child = context.Pipe()
            proc = context.Process(
                target=stores.holder_main,
                args=(child, name, control, list(sizes), counts, seed),
                daemon=True,
            )
            proc.start()
            holders.append((parent, proc))
            if not parent.poll(HOLDER_READY_S) or parent.recv() != "ready":
                raise RuntimeError(f"{name} holder did not get ready in {HOLDER_READY_S} s")
        for name in systems:
            readers[name] = stores.open_store(name, control, 0)
        if "kvflow" in systems:
            readers[TCP_READER] = stores.open_store("kvflow", control, 0, same_host_shm=False)
        results = []
        for size, count in zip(sizes, counts, strict=True):
            values = stores.values_for(size, count, seed)
            keys = stores.object_keys("remote", size, count)
            calls: dict[str, _Reader] = {}
            dsts = {}
            for name, store in readers.items():
                _await_visible(store, keys, name)
                dsts[name] = np.zeros_like(values)
                calls[name] = _Reader(store, keys, size, dsts[name])
            runs = _rounds(dict(calls), values.nbytes, repeat)
            for name in readers:
                _check(dsts[name], values, f"remote {name}")
            ratios = _ratios(runs, systems, None)
            if TCP_READER in runs and "mooncake" in runs:
                ratios[f"{TCP_READER}/mooncake"] = _per_round(runs, TCP_READER, "mooncake")
            results.append({"size": size, "count": count, "get": runs, "ratios": ratios})
            for call in calls.values():
                call.close()
            del calls, dsts
        return results
    finally:
        for store in readers.values():
            store.close()
        for parent, proc in holders:
            stop_server_process(parent, proc)


def summary(report: dict[str, Any]) -> str:
    parts = []
    for where in ("local", "remote"):
        cells = []
        for r in report[where]:
            get = r["get"]
            cell = f"{label(r['size'])} kvflow {get['kvflow']['gbps']:.2f}"
            if "mooncake" in get:
                cell += f" vs mooncake {get['mooncake']['gbps']:.2f} GB/s"
                cell += f" (x{r['ratios']['kvflow/mooncake']:.2f})"
            else:
                cell += " GB/s"
            if TCP_READER in get:
                cell += f"; over tcp {get[TCP_READER]['gbps']:.2f}"
                if f"{TCP_READER}/mooncake" in r["ratios"]:
                    cell += f" (x{r['ratios'][f'{TCP_READER}/mooncake']:.2f})"
            if "memcpy" in get:
                cell += f", {100 * r['ratios']['kvflow/memcpy']:.0f}% of memcpy"
                cell += f" {get['memcpy']['gbps']:.2f}"
            cells.append(cell)
        parts.append(f"{where} batch_get_into: " + "; ".join(cells))
    puts = "; ".join(
        f"{label(r['size'])} " + " vs ".join(f"{n} {v['gbps']:.2f}" for n, v in r["put"].items())
        for r in report["local"]
    )
    parts.append(f"put GB/s: {puts}")
    if report["mooncake_skipped"]:
        parts.append("mooncake skipped")
    load = report["loadavg"]
    parts.append(f"load {load['before'][0]:.1f}->{load['after'][0]:.1f}")
    return "bench_mooncake: " + " | ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64KiB,1MiB,4MiB", help="comma-separated, e.g. 64KiB")
    parser.add_argument("--working-set-mib", type=float, default=128.0, help="values per size")
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (one more dropped)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-mooncake", action="store_true", help="measure kvflow alone")
    parser.add_argument("--no-remote", action="store_true", help="only put and local reads")
    parser.add_argument("--json", default=None, help="write the full results here")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if args.repeat < 1 or not sizes or min(sizes) <= 0:
        parser.error("--repeat must be >= 1 and --sizes positive")
    counts = [max(4, int(args.working_set_mib * (1 << 20)) // s) for s in sizes]
    missing = "--skip-mooncake" if args.skip_mooncake else stores.mooncake_missing()
    if missing is not None and not args.skip_mooncake:
        print(
            f"bench_mooncake: Mooncake unavailable ({missing}); skipping its columns.\n"
            f"{stores.INSTALL_HINT}",
            file=sys.stderr,
        )
    systems = ["kvflow"] if missing else ["kvflow", "mooncake"]
    report: dict[str, Any] = {
        "benchmark": "mooncake_side_by_side",
        "args": vars(args),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "mooncake_skipped": missing,
        "loadavg": {"before": os.getloadavg()},
    }
    with stores.control_plane("mooncake" in systems) as control:
        report["local"] = run_local(systems, control, sizes, counts, args.repeat, args.seed)
        report["remote"] = (
            []
            if args.no_remote
            else run_remote(systems, control, sizes, counts, args.repeat, args.seed)
        )
    report["loadavg"]["after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
