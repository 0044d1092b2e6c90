"""Structured-output benchmark: decode tokens/s with a JSON-schema grammar against the same
requests unconstrained, in one run on one engine, and the compile time of a 50-field schema.

Both sides decode the same number of tokens per request (ignore_eos; the constrained side's
grammar allows whitespace inside the object, so it never has to stop early: the schema's
string fields are long enough), batched as the server batches them. Seeded; prints one
summary line; `--json PATH` writes every number.

    python -m kvflow.tools.bench.grammar                 # the default model
    python -m kvflow.tools.bench.grammar --quick         # the tiny demo model, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvflow.stages.engine import Engine, EngineConfig, GrammarSpec, SamplingParams, write_demo_model

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "summary": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["title", "summary", "tags", "score"],
}


def wide_schema(fields: int) -> dict[str, Any]:
    """A flat object schema of ``fields`` typed fields, every one required."""
    kinds = ["string", "integer", "number", "boolean"]
    props = {f"field_{i}": {"type": kinds[i % len(kinds)]} for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)}


def decode_rate(engine: Engine, prompt: list[int], grammar: GrammarSpec | None, args: Any) -> float:
    """Generated tokens per second over ``args.batch`` requests decoding together."""
    for i in range(args.batch):
        sampling = SamplingParams(
            max_tokens=args.tokens,
            temperature=1.0,
            seed=args.seed + i,
            grammar=grammar,
            ignore_eos=True,
        )
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, sampling)
    produced, start = 0, None
    while engine.has_unfinished():
        outs = engine.step()
        if start is None:  # the prefill step: decode is timed from here
            start = time.perf_counter()
            continue
        produced += sum(len(o.new_token_ids) for o in outs)
    assert start is not None
    return produced / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny demo model")
    p.add_argument("--model", type=Path, help="a model directory (default: the default model)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            model = args.model
        elif args.quick:
            model = write_demo_model(Path(tmp) / "tiny", "tiny", seed=args.seed)
        else:
            from kvflow.stages.engine.default_model import ensure_default_model

            model = ensure_default_model(Path(tmp) / "data")
        engine = Engine.open(model, EngineConfig(block_size=16, num_pages=512))
        prompt = engine.tokenizer.encode("Write a JSON review of a book:")
        grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
        engine.grammars.compile(grammar)  # compile time is measured apart, below
        free, constrained = [], []
        decode_rate(engine, prompt, None, args)  # warm-up
        for _ in range(args.repeat):  # alternate, so drift in the machine hits both sides
            free.append(decode_rate(engine, prompt, None, args))
            constrained.append(decode_rate(engine, prompt, grammar, args))
        wide = GrammarSpec("json_schema", json.dumps(wide_schema(50)))
        start = time.perf_counter()
        engine.grammars.compile(wide)
        compile_s = time.perf_counter() - start
    f, c = statistics.median(free), statistics.median(constrained)
    result = {
        "model": str(model.name),
        "batch": args.batch,
        "tokens": args.tokens,
        "free_tok_s": free,
        "constrained_tok_s": constrained,
        "median_free_tok_s": f,
        "median_constrained_tok_s": c,
        "slowdown": 1 - c / f,
        "compile_50_fields_s": compile_s,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    print(
        f"grammar: {model.name} batch {args.batch}: free {f:.1f} tok/s, json_schema {c:.1f} "
        f"tok/s ({100 * (1 - c / f):+.1f}% slower); 50-field schema compiled in "
        f"{1000 * compile_s:.1f} ms"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
