"""Thread-placement benchmark: a prefill and a decode engine in one process (as the embedded
server runs them), each stepping on its own thread, under each intra-op thread policy.

A policy ``P/D`` is the intra-op thread count (``torch.set_num_threads``, called on the
engine's own thread) of the prefill / the decode engine's thread; ``N`` means ``N/N``.
For each policy in `--threads` measures, best of `--repeat`:
- `decode_alone`: decode tokens/s at batch `--batch` with the prefill engine idle;
- `prefill_alone`: prefill tokens/s of `--prompt`-token prompts with the decode engine idle;
- `decode_busy` / `prefill_busy`: both at once: decode tokens/s while the prefill engine
  computes prompts back to back, and the prefill tokens/s meanwhile.

    python -m kvflow.tools.bench.threads                     # default model, 2/2 1/1 2/1
    python -m kvflow.tools.bench.threads --quick --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.stages.engine.default_model import ensure_default_model
from kvflow.tools.bench._meta import run_meta

# Request ids unique across runners: a stopped job leaves its requests in the engine, and
# the next job's steps finish them.
_IDS = itertools.count()


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


class Runner:
    """One engine on its own thread, running `job` until told to stop; counts tokens."""

    def __init__(self, engine: Engine, threads: int, job: Any) -> None:
        self.engine, self.threads, self.job = engine, threads, job
        self.tokens = 0
        self.last = 0.0  # when the last counted tokens were done
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # this thread's count (threads.py)
        i = 0
        while not self.stop.is_set():
            for n in self.job(self.engine, i):  # tokens per step
                if n and not self.stop.is_set():
                    self.tokens += n
                    self.last = time.perf_counter()
                if self.stop.is_set():
                    break
            i += 1


def prefill_job(prompt: int) -> Any:
    def job(engine: Engine, i: int) -> Iterator[int]:
        ids = _prompt(prompt, 1000 + i, engine.spec.vocab_size)
        engine.add_request(f"p{next(_IDS)}", ids, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            yield prompt if any(o.finished for o in engine.step()) else 0

    return job


def decode_job(batch: int, context: int, steps: int) -> Any:
    def job(engine: Engine, i: int) -> Iterator[int]:
        sampling = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
        rids = [f"d{next(_IDS)}" for _ in range(batch)]
        for b, rid in enumerate(rids):
            engine.add_request(rid, _prompt(context, b, engine.spec.vocab_size), sampling)
        while any(engine.num_computed_tokens(rid) < context for rid in rids):
            engine.step()  # the prompts: not counted
        while engine.has_unfinished():
            yield sum(len(o.new_token_ids) for o in engine.step())
        yield 0

    return job


def measure(runners: list[Runner], seconds: float) -> list[float]:
    """Tokens/s of each runner: the tokens done within a `seconds` window over the time from
    the window's start to the last of them (a 512-token prefill finishes a few times a second:
    counting whole requests per window alone would round the rate to a multiple of 512/s)."""
    start = time.perf_counter()
    for r in runners:
        r.thread.start()
    time.sleep(seconds)  # a measurement window, not a wait for an event
    for r in runners:
        r.stop.set()
    for r in runners:
        r.thread.join(600)
    return [r.tokens / (r.last - start) if r.tokens else 0.0 for r in runners]


def bench_policy(
    engines: tuple[Engine, Engine], policy: tuple[int, int], args: argparse.Namespace
) -> dict:
    pre, dec = engines

    def run(which: str) -> list[float]:
        rs = []
        if which in ("prefill", "both"):
            rs.append(Runner(pre, policy[0], prefill_job(args.prompt)))
        if which in ("decode", "both"):
            rs.append(Runner(dec, policy[1], decode_job(args.batch, 64, args.steps)))
        return measure(rs, args.seconds)

    out: dict[str, Any] = {"threads": "/".join(map(str, policy))}
    out["prefill_alone"] = max(run("prefill")[0] for _ in range(args.repeat))
    out["decode_alone"] = max(run("decode")[0] for _ in range(args.repeat))
    both = [run("both") for _ in range(args.repeat)]
    out["prefill_busy"] = max(b[0] for b in both)
    out["decode_busy"] = max(b[1] for b in both)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvflow.tools.bench.threads", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", type=Path, help="model directory (default: the default model)")
    p.add_argument("--data-dir", type=Path, help="where the default model is imported (a tmp dir)")
    p.add_argument(
        "--threads",
        default="2/2,1/1,2/1",
        help="comma-separated policies P/D (prefill / decode thread's intra-op threads) or N",
    )
    p.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens")
    p.add_argument("--batch", type=int, default=1, help="decode batch")
    p.add_argument("--steps", type=int, default=16, help="decode tokens per request")
    p.add_argument("--seconds", type=float, default=20.0, help="each measurement window")
    p.add_argument("--repeat", type=int, default=2, help="best of this many windows")
    p.add_argument("--quick", action="store_true", help="short windows, one repeat")
    p.add_argument("--json", type=Path, help="write full results here")
    return p


def _counts(value: str) -> list[tuple[int, int]]:
    out = []
    for item in value.split(","):
        p, _, d = item.strip().partition("/")
        d = d or p
        if not (p.isdigit() and d.isdigit() and int(p) > 0 and int(d) > 0):
            raise SystemExit(f"--threads: {item!r} is not N or P/D with positive counts")
        out.append((int(p), int(d)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counts = _counts(args.threads)
    if args.quick:
        args.prompt, args.steps, args.seconds, args.repeat = 32, 4, 0.25, 1
    with tempfile.TemporaryDirectory(prefix="kvflow-threads-") as tmp:
        model_dir = args.model or ensure_default_model(args.data_dir or Path(tmp))
        config = EngineConfig(num_pages=4 * (args.batch + 2) + 16, max_batch=args.batch, seed=0)
        engines = (Engine.open(model_dir, config), Engine.open(model_dir, config))
        for engine in engines:  # warm-up: first touch of the weights and pages
            for _ in prefill_job(args.prompt)(engine, -1):
                pass
        rows = [bench_policy(engines, n, args) for n in counts]
        if len(counts) > 1:  # the other order too (A B B A); each number the better of two
            again = {
                r["threads"]: r for r in (bench_policy(engines, n, args) for n in counts[::-1])
            }
            rows = [{k: max(v, again[r["threads"]][k]) for k, v in r.items()} for r in rows]
        label = model_dir.name
    summary = f"bench_threads {label} prompt {args.prompt} decode b{args.batch}: " + " | ".join(
        f"{r['threads']}: prefill {r['prefill_alone']:.0f} alone "
        f"{r['prefill_busy']:.0f} busy tok/s, "
        f"decode {r['decode_alone']:.1f} alone {r['decode_busy']:.1f} busy tok/s"
        for r in rows
    )
    print(summary)
    if args.json:
        meta = run_meta(args)
        args.json.write_text(json.dumps({"summary": summary, "meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
