"""Mixed-load benchmark: do running streams stall while a long prompt is prefilled?

Against ``kvflow serve`` (the embedded server, a process of its own on free ports, clients
over its OpenAI HTTP API, as users see it): `--streams` streaming requests decode (short
prompts, ``ignore_eos``); once each has produced `--warm-tokens` tokens, one long cold prompt
(`--long-words` random words, about 1.3 tokens a word) is submitted. Measured:

- ``tbt_before`` p50/p99: gaps between consecutive tokens of the streams before the long prompt;
- ``tbt_during`` p50/p99/max: the gaps that overlap the long prompt's prefill (from its
  submission to its first token);
- ``long_ttft_s``: the long prompt's time to first token; ``long_prompt_tokens``.

Each ``--variant NAME=FLAGS`` is a server started with those extra ``kvflow serve`` flags;
variants run in the order A B B A ... (``--rounds`` times each, alternating) so that load
drift hits all of them alike; one server at a time. Seeded; one summary line; ``--json``.

    python -m kvflow.tools.bench.mixed --variant disagg= --variant coloc=--colocate
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvflow.tools.bench._meta import run_meta
from kvflow.tools.bench._servers import start_embedded, stop_embedded
from kvflow.tools.bench.load import WORDS, Target, pct


async def _stream(
    session: Any, target: Target, text: str, max_tokens: int, arrivals: list[float]
) -> dict[str, Any]:
    """One streaming completion; appends each token event's arrival time to `arrivals`."""
    body = {
        "model": target.model,
        "prompt": text,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict[str, Any] = {}
    async with session.post(target.url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            choices = event.get("choices") or []
            if choices and choices[0].get("text"):
                arrivals.append(time.perf_counter())
    return usage


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _gaps(arrivals: list[float], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive arrivals whose interval overlaps [lo, hi]."""
    return [b - a for a, b in itertools.pairwise(arrivals) if b > lo and a < hi]


async def one_round(target: Target, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import aiohttp

    rng = random.Random(seed)
    texts = [_words(rng, args.stream_words) for _ in range(args.streams)]
    long_text = _words(rng, args.long_words)
    timeout = aiohttp.ClientTimeout(total=args.deadline_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        streams: list[list[float]] = [[] for _ in texts]
        tasks = [
            asyncio.create_task(_stream(session, target, t, args.stream_tokens, arr))
            for t, arr in zip(texts, streams, strict=True)
        ]
        deadline = time.monotonic() + args.deadline_s
        while min(len(a) for a in streams) < args.warm_tokens:
            if time.monotonic() > deadline or any(t.done() for t in tasks):
                for t in tasks:
                    t.cancel()
                raise RuntimeError("the streams did not warm up (or ended early)")
            await asyncio.sleep(0.005)
        submitted = time.perf_counter()
        long_arrivals: list[float] = []
        usage = await _stream(session, target, long_text, 1, long_arrivals)
        first = long_arrivals[0] if long_arrivals else time.perf_counter()
        running = sum(1 for t in tasks if not t.done())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    before = [b - a for arr in streams for a, b in itertools.pairwise(arr) if b <= submitted]
    during = [g for arr in streams for g in _gaps(arr, submitted, first)]
    return {
        "long_ttft_s": first - submitted,
        "long_prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "streams_running_at_end": running,
        "tbt_before_p50_s": pct(before, 50),
        "tbt_before_p99_s": pct(before, 99),
        "tbt_during_p50_s": pct(during, 50),
        "tbt_during_p99_s": pct(during, 99),
        "tbt_during_max_s": max(during, default=0.0),
        "tokens_during": len(during),
    }


def engine_round(
    engine: Any, args: argparse.Namespace, seed: int, tag: str, threads: int
) -> dict[str, Any]:
    """The same load on one in-process engine (what a colocated server's step loop runs):
    the streams' TBT is the time of each step that carries their tokens."""
    import torch

    from kvflow.stages.engine import SamplingParams

    torch.set_num_threads(threads)
    rng = random.Random(seed)
    vocab = engine.spec.vocab_size
    stream = SamplingParams(max_tokens=args.stream_tokens, ignore_eos=True)
    for i in range(args.streams):
        ids = [rng.randrange(100, vocab) for _ in range(args.stream_words)]
        engine.add_request(f"{tag}-s{i}", ids, stream)
    counts = dict.fromkeys((f"{tag}-s{i}" for i in range(args.streams)), 0)
    while min(counts.values()) < args.warm_tokens:
        for o in engine.step():
            counts[o.request_id] += len(o.new_token_ids)
    long_ids = [rng.randrange(100, vocab) for _ in range(args.long_tokens)]
    engine.add_request(f"{tag}-long", long_ids, SamplingParams(max_tokens=1, ignore_eos=True))
    submitted = time.perf_counter()
    during: list[float] = []
    last = submitted
    first = None
    while first is None:
        outs = engine.step()
        now = time.perf_counter()
        if any(o.new_token_ids for o in outs if o.request_id != f"{tag}-long"):
            during.append(now - last)
            last = now
        if any(o.request_id == f"{tag}-long" and o.new_token_ids for o in outs):
            first = now
    for rid in counts:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return {
        "long_ttft_s": first - submitted,
        "long_prompt_tokens": args.long_tokens,
        "tbt_during_p50_s": pct(during, 50),
        "tbt_during_p99_s": pct(during, 99),
        "tbt_during_max_s": max(during, default=0.0),
        "tokens_during": len(during) * args.streams,
    }


def run_engine_bench(args: argparse.Namespace) -> dict[str, Any]:
    """``--engine``: variants are ``NAME=mixed:on|off chunk:N mixchunk:N target:MS`` engine
    settings (mixed_forward, prefill_chunk, mixed_chunk, tbt_target_ms), one engine per
    variant, all with every core."""
    from kvflow.stages.engine import Engine, EngineConfig
    from kvflow.stages.runtime.threads import cores

    model = _model(args)
    variants = dict(_variants(args.variant or ["mixed=mixed:on", "separate=mixed:off"]))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    engines = {}
    for name, flags in variants.items():
        opts = dict(f.split(":", 1) for f in flags)
        config = EngineConfig(
            num_pages=256,
            prefill_chunk=int(opts.get("chunk", 512)),
            mixed_forward=opts.get("mixed", "on") == "on",
            mixed_chunk=int(opts["mixchunk"]) if "mixchunk" in opts else None,
            tbt_target_ms=float(opts["target"]) if "target" in opts else None,
        )
        engines[name] = Engine.open(model, config)
    for i, name in enumerate(_order(list(variants), args.rounds)):
        engine_round(engines[name], args, args.seed, f"w{i}", cores())  # warm caches
        results[name].append(engine_round(engines[name], args, args.seed, f"r{i}", cores()))
    summary = {name: _median(rs) for name, rs in results.items()}
    meta = run_meta(args) | {"load_avg": list(os.getloadavg())}
    return {"meta": meta, "runs": results, "summary": summary}


def _model(args: argparse.Namespace) -> Path:
    """--model, or the default model imported under --data-dir (a temporary one if unset)."""
    from kvflow.stages.engine.default_model import ensure_default_model

    if args.model:
        return Path(args.model)
    return ensure_default_model(args.data_dir or tempfile.mkdtemp(prefix="kvflow-mixed-model-"))


def _variants(given: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for v in given:
        name, sep, flags = v.partition("=")
        if not sep or not name:
            raise SystemExit(f"--variant must be NAME=FLAGS, got {v!r}")
        out.append((name, flags.split()))
    return out


def _order(names: list[str], rounds: int) -> list[str]:
    """A B B A A B ...: each round reverses the previous one's order."""
    order: list[str] = []
    for r in range(rounds):
        order.extend(names if r % 2 == 0 else reversed(names))
    return order


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    model = _model(args)
    variants = dict(_variants(args.variant or ["embedded="]))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="kvflow-mixed-") as tmp:
        for i, name in enumerate(_order(list(variants), args.rounds)):
            flags = [*args.server_args.split(), *variants[name]]
            server = start_embedded(model, Path(tmp) / f"{i}-{name}", flags)
            target = Target.of(server)
            try:
                # warm-up: one short request, so the first forward's set-up is not measured
                asyncio.run(_warm(target))
                results[name].append(asyncio.run(one_round(target, args, args.seed)))
            finally:
                stop_embedded(server.proc)
    summary = {name: _median(rs) for name, rs in results.items()}
    meta = run_meta(args) | {"load_avg": list(os.getloadavg())}
    return {"meta": meta, "runs": results, "summary": summary}


async def _warm(target: Target) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        await _stream(session, target, "hello there", 4, [])


def _median(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _line(summary: dict[str, dict[str, float]]) -> str:
    def ms(s: dict[str, float], key: str) -> str:
        return f"{s[key] * 1e3:.0f}" if key in s else "-"

    parts = []
    for name, s in summary.items():
        parts.append(
            f"{name}: long TTFT {s['long_ttft_s']:.2f}s ({s['long_prompt_tokens']:.0f} tok), "
            f"TBT during p50/p99/max {ms(s, 'tbt_during_p50_s')}/{ms(s, 'tbt_during_p99_s')}/"
            f"{ms(s, 'tbt_during_max_s')} ms (before p50/p99 {ms(s, 'tbt_before_p50_s')}/"
            f"{ms(s, 'tbt_before_p99_s')} ms)"
        )
    return "mixed: " + "; ".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data-dir", help="where the default model is imported (default: a temp dir)")
    p.add_argument(
        "--variant",
        action="append",
        help="NAME=FLAGS: a server started with these extra `kvflow serve` flags (repeatable; "
        "default: one variant, the embedded server as it is)",
    )
    p.add_argument("--server-args", default="", help="flags every variant gets, one string")
    p.add_argument("--streams", type=int, default=4, help="decoding streams")
    p.add_argument("--stream-words", type=int, default=16, help="words per stream's prompt")
    p.add_argument("--stream-tokens", type=int, default=400, help="max_tokens of a stream")
    p.add_argument("--warm-tokens", type=int, default=8, help="tokens each stream has first")
    p.add_argument("--long-words", type=int, default=1500, help="words of the long prompt")
    p.add_argument(
        "--engine",
        action="store_true",
        help="one in-process engine instead of a server; --variant NAME=mixed:on|off "
        "chunk:N mixchunk:N target:MS (default: mixed=mixed:on separate=mixed:off)",
    )
    p.add_argument("--long-tokens", type=int, default=2000, help="--engine: the long prompt")
    p.add_argument("--rounds", type=int, default=2, help="runs of each variant (alternating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=300.0)
    p.add_argument("--json", help="write every number here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = add_arguments(argparse.ArgumentParser(description=__doc__)).parse_args(argv)
    os.environ.setdefault("KVFLOW_LOG_LEVEL", "WARNING")
    out = run_engine_bench(args) if args.engine else run_bench(args)
    print(_line(out["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
