"""Benchmark what a crash costs a client: kill one process of a running cluster, measure.

Starts `kvflow cluster` as a library (LocalCluster: 3 metadata replicas, 2 prefill, 2 decode
nodes, 2 routers, the tiny demo model unless --model), supervised like the CLI (a killed process
is restarted). For each victim in turn — router-0, decode-0, prefill-0, the metadata leader,
then both decode nodes at once — it:

1. starts a long answer (``--max-tokens``, greedy, ignore_eos) through an InferenceClient that
   lists both routers, and waits for its first token;
2. SIGKILLs the victim, and at once sends ``--requests`` short requests from as many threads;
3. records the longest gap between two messages of the long answer and the latency of every
   short request, and checks every output against a reference run made just before the kill
   (whose longest gap and short-request latency are reported beside, as the baseline).

One summary line; ``--json PATH`` writes every phase. Failed requests and wrong outputs are
counted, never hidden: the run exits 1 if there is any.

    .venv/bin/python -m kvflow.tools.bench.failover [--requests 4] [--max-tokens 300]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient
from kvflow.stages.engine import write_demo_model
from kvflow.tools.supervise import LocalCluster

PHASES = ("router-0", "decode-0", "prefill-0", "meta-leader", "decode-0+decode-1")


def _request(ids: list[int], max_tokens: int) -> Any:
    req = pb2.GenerateRequest(max_tokens=max_tokens, sampling=pb2.SamplingParams(ignore_eos=True))
    req.token_ids.ids.extend(ids)
    return req


def _stream(client: InferenceClient, req: Any) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    times: list[float] = []
    for msg in client.generate(req, timeout=300):
        tokens.extend(msg.token_ids)
        times.append(time.perf_counter())
    return tokens, times


def _short(addresses: list[str], req: Any) -> tuple[list[int] | None, float, str]:
    started = time.perf_counter()
    try:
        with InferenceClient(addresses) as client:
            tokens, _ = _stream(client, req)
        return tokens, time.perf_counter() - started, ""
    except Exception as exc:  # counted as a failed request
        return None, time.perf_counter() - started, f"{type(exc).__name__}: {exc}"


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def _supervise(cluster: LocalCluster, stop: threading.Event) -> None:
    while not stop.is_set():
        cluster.supervise_once()
        stop.wait(0.2)


def _phase(
    cluster: LocalCluster,
    victim: str,
    long_req: Any,
    long_ref: list[int],
    shorts: list[tuple[Any, list[int]]],
) -> dict[str, Any]:
    names = [cluster.metadata_leader() or "meta-0"] if victim == "meta-leader" else []
    names = names or victim.split("+")
    client = InferenceClient(cluster.addresses)
    stream = client.generate(long_req, timeout=300)
    first = next(stream)
    tokens, times = list(first.token_ids), [time.perf_counter()]
    killed_at = time.perf_counter()
    for name in names:
        cluster.kill(name, keep_down=False)
    with ThreadPoolExecutor(len(shorts)) as pool:
        futures = [pool.submit(_short, cluster.addresses, req) for req, _ in shorts]
        for msg in stream:
            tokens.extend(msg.token_ids)
            times.append(time.perf_counter())
        results = [f.result() for f in futures]
    client.close()
    gaps = _gaps(times)
    errors = [err for _, _, err in results if err]
    wrong = sum(
        out is not None and out != ref
        for (out, _, _), (_, ref) in zip(results, shorts, strict=True)
    )
    return {
        "victim": victim,
        "killed": names,
        "long_answer_ok": tokens == long_ref,
        "long_answer_max_gap_s": round(max(gaps, default=0.0), 3),
        "long_answer_client_failovers": client.failovers,
        "short_requests": len(shorts),
        "short_failed": len(errors),
        "short_wrong": wrong,
        "short_latency_max_s": round(max(lat for _, lat, _ in results), 3),
        "short_latency_median_s": round(sorted(lat for _, lat, _ in results)[len(results) // 2], 3),
        "errors": errors,
        "seconds_since_kill": round(time.perf_counter() - killed_at, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="model directory (default: the tiny demo model)")
    p.add_argument("--requests", type=int, default=4, help="short requests sent after each kill")
    p.add_argument("--max-tokens", type=int, default=300, help="tokens of the long answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every phase here")
    args = p.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 2:
        p.error("--requests must be >= 1 and --max-tokens >= 2")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvflow-failover-") as tmp:
        model = args.model or write_demo_model(Path(tmp) / "tiny", preset="tiny", seed=0)
        cluster = LocalCluster(
            Path(tmp) / "cluster",
            meta=3,
            prefill=2,
            decode=2,
            model=model,
            routers=2,
            extra=("--block-size", "16", "--num-pages", "512", "--dram-mb", "64"),
        )
        stop = threading.Event()
        phases: list[dict[str, Any]] = []
        try:
            cluster.start(timeout_s=180)
            supervisor = threading.Thread(target=_supervise, args=(cluster, stop), daemon=True)
            supervisor.start()
            for victim in PHASES:
                ids = [rng.randrange(3, 300) for _ in range(64)]
                long_req = _request(ids, args.max_tokens)
                short_reqs = [
                    _request([rng.randrange(3, 300) for _ in range(48)], 16)
                    for _ in range(args.requests)
                ]
                with InferenceClient(cluster.addresses) as client:  # references, before the kill
                    long_ref, ref_times = _stream(client, long_req)
                    shorts, ref_latency = [], []
                    for r in short_reqs:
                        started = time.perf_counter()
                        shorts.append((r, _stream(client, r)[0]))
                        ref_latency.append(time.perf_counter() - started)
                phase = _phase(cluster, victim, long_req, long_ref, shorts)
                phase["baseline_max_gap_s"] = round(max(_gaps(ref_times), default=0.0), 3)
                phase["baseline_short_latency_max_s"] = round(max(ref_latency), 3)
                phases.append(phase)
                cluster.wait_all(timeout_s=120)  # every process back before the next one
        finally:
            stop.set()
            cluster.stop()
    failed = sum(
        ph["short_failed"] + ph["short_wrong"] + (not ph["long_answer_ok"]) for ph in phases
    )
    summary = ", ".join(
        f"{ph['victim']}: gap {ph['long_answer_max_gap_s']:.2f}s "
        f"(no kill {ph['baseline_max_gap_s']:.2f}s), short max {ph['short_latency_max_s']:.2f}s "
        f"(no kill {ph['baseline_short_latency_max_s']:.2f}s)"
        for ph in phases
    )
    total = sum(ph["short_requests"] + 1 for ph in phases)
    print(f"bench_failover: {failed} failed or wrong of {total} requests; {summary}")
    if args.json:
        args.json.write_text(json.dumps({"phases": phases, "failed_or_wrong": failed}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
