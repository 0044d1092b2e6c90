"""Model-layer benchmark: streaming detokenization, and the real default model's CPU prefill
and decode through kvflow's engine against transformers on the same weights and threads.

    python -m kvflow.tools.bench.model                 # default model, 2 threads
    python -m kvflow.tools.bench.model --quick --json out.json

Detokenize: a seeded stream of `--detok-tokens` ids (ordinary vocabulary tokens of the model)
fed one id at a time through IncrementalDetokenizer (DecodeStream), with and without stop
strings; best of `--repeat`. Prefill: one `--prefill-len`-token prompt through the engine
(chunked prefill, paged KV) and through transformers' forward. Decode: `--decode-steps` greedy
steps after a `--decode-context`-token prompt, engine vs transformers with its KV cache.
float32 everywhere; prints one summary line; `--json PATH` writes every number.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvflow.stages.detokenize import IncrementalDetokenizer
from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.stages.engine.default_model import ensure_default_model
from kvflow.tools.bench._meta import run_meta


def _ids(seed: int, n: int, lo: int, hi: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(lo, hi) for _ in range(n)]


def bench_detokenize(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    ids = _ids(args.seed, args.detok_tokens, 64, engine.spec.vocab_size)
    results: dict[str, Any] = {"tokens": len(ids)}
    for name, stop in (("plain_ms", ()), ("stop_ms", ("<never>", "\n\n\n\n"))):
        best = float("inf")
        for _ in range(args.repeat):
            detok = IncrementalDetokenizer(engine.tokenizer, stop=stop)
            start = time.perf_counter()
            for i in ids:
                detok.add((i,))
            detok.flush()
            best = min(best, time.perf_counter() - start)
        results[name] = best * 1e3
    return results


def _engine_prefill_s(engine: Engine, ids: list[int], rid: str) -> float:
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def _engine_decode_s(engine: Engine, ids: list[int], steps: int, rid: str) -> float:
    engine.add_request(rid, ids, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prefill (and the first token)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) / steps


@torch.inference_mode()
def _hf_prefill_s(model: Any, ids: list[int]) -> float:
    start = time.perf_counter()
    model(torch.tensor([ids]), use_cache=True)
    return time.perf_counter() - start


@torch.inference_mode()
def _hf_decode_s(model: Any, ids: list[int], steps: int) -> float:
    out = model(torch.tensor([ids]), use_cache=True)
    cache, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
    start = time.perf_counter()
    for _ in range(steps):
        out = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        cache, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
    return (time.perf_counter() - start) / steps


def bench_speed(engine: Engine, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.eval()
    vocab = engine.spec.vocab_size
    prompt = _ids(args.seed + 1, args.prefill_len, 64, vocab)
    context = _ids(args.seed + 2, args.decode_context, 64, vocab)
    _engine_prefill_s(engine, prompt[:32], "warm")  # first-call allocations
    _hf_prefill_s(hf, prompt[:32])
    ours_p = min(_engine_prefill_s(engine, prompt, f"p{i}") for i in range(args.repeat))
    theirs_p = min(_hf_prefill_s(hf, prompt) for _ in range(args.repeat))
    ours_d = min(
        _engine_decode_s(engine, context, args.decode_steps, f"d{i}") for i in range(args.repeat)
    )
    theirs_d = min(_hf_decode_s(hf, context, args.decode_steps) for _ in range(args.repeat))
    return {
        "prefill_tokens": len(prompt),
        "prefill_tok_s": len(prompt) / ours_p,
        "hf_prefill_tok_s": len(prompt) / theirs_p,
        "prefill_speed_ratio": theirs_p / ours_p,
        "decode_context": len(context),
        "decode_tok_s": 1.0 / ours_d,
        "hf_decode_tok_s": 1.0 / theirs_d,
        "decode_speed_ratio": theirs_d / ours_d,
    }


def _summary(name: str, threads: int, detok: dict[str, Any], speed: dict[str, Any] | None) -> str:
    line = (
        f"bench_model {name}: detokenize {detok['tokens']} tokens {detok['plain_ms']:.1f} ms "
        f"({detok['stop_ms']:.1f} ms with stop strings)"
    )
    if speed:
        line += (
            f" | {threads} threads fp32: prefill {speed['prefill_tokens']} "
            f"{speed['prefill_tok_s']:.0f} tok/s vs transformers {speed['hf_prefill_tok_s']:.0f} "
            f"(x{speed['prefill_speed_ratio']:.2f}), decode {speed['decode_tok_s']:.1f} tok/s vs "
            f"{speed['hf_decode_tok_s']:.1f} (x{speed['decode_speed_ratio']:.2f})"
        )
    return line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvflow.tools.bench_model", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="model directory (default: the default model)")
    p.add_argument("--data-dir", type=Path, help="where the default model is imported (a tmp dir)")
    p.add_argument("--threads", type=int, default=2, help="torch threads, for both engines")
    p.add_argument("--detok-tokens", type=int, default=4096)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--decode-context", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3, help="best of this many timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--detok-only", action="store_true", help="skip the prefill/decode part")
    p.add_argument("--quick", action="store_true", help="short sequences, one repeat")
    p.add_argument("--json", type=Path, help="write full results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.prefill_len, args.decode_context, args.decode_steps, args.repeat = 64, 32, 4, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-model-") as tmp:
        model_dir = args.model or ensure_default_model(args.data_dir or Path(tmp))
        config = EngineConfig(dtype="float32", block_size=64, num_pages=64, prefill_chunk=512)
        engine = Engine.open(model_dir, config)
        detok = bench_detokenize(engine, args)
        speed = None if args.detok_only else bench_speed(engine, model_dir, args)
    summary = _summary(engine.card.name, args.threads, detok, speed)
    print(summary)
    if args.json:
        meta = run_meta(args)
        doc = {"meta": meta, "summary": summary, "detokenize": detok, "speed": speed}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
