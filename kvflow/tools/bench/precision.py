"""Precision benchmark: what a lower engine dtype costs in accuracy against float32.

`--dtype` takes one or more (comma-separated) of bfloat16, float16, int8, int4. For each
prompt, the float32 engine and each `--dtype` engine decode `--tokens` tokens
greedily; reported, over all prompts:
- `identical`: prompts whose whole greedy output is the same token for token;
- `agreement`: teacher-forced top-1 agreement: the `--dtype` engine scores the float32 text
  (prompt + float32 output) and each output position counts when its most likely token is the
  one float32 chose (a divergence early in a text does not hide later agreement);
- `max_logit_diff` (and the largest logit's magnitude, for scale): the largest |difference| of
  the logits while both engines' contexts are still identical (up to and including the first
  diverging step).

The prompts are the engine equivalence tests' token prompt (37 ids drawn from [3, 300) with
seed 5, as tests/stages/engine/test_hf_equivalence.py draws them) and `PROMPTS`' texts.
Seeded and deterministic; one summary line; `--json PATH` writes every number.

    python -m kvflow.tools.bench.precision                    # default model, bfloat16
    python -m kvflow.tools.bench.precision --dtype bfloat16,int8,int4 --json out.json
    python -m kvflow.tools.bench.precision --quick --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.stages.engine.default_model import ensure_default_model
from kvflow.stages.engine.precision import PRECISIONS
from kvflow.tools.bench import _cli
from kvflow.tools.bench._meta import run_meta

PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a paperclip:",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?",
)


def equivalence_prompt() -> list[int]:
    """The equivalence tests' prompt: 37 token ids in [3, 300), seed 5."""
    gen = torch.Generator().manual_seed(5)
    return [int(t) for t in torch.randint(3, 300, (37,), generator=gen)]


def greedy(engine: Engine, rid: str, prompt: list[int], n: int) -> tuple[list[int], list]:
    """`n` greedy tokens and the float32 logits each came from."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if out.logits is not None:
                logits.extend(out.logits)
    return tokens, logits


def teacher_forced_hits(engine: Engine, rid: str, prompt: list[int], ref: list[int]) -> int:
    """Positions of `ref` (the reference output after `prompt`) where `engine`'s most likely
    next token, given the reference text before it, is the reference token."""
    sampling = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    engine.add_request(rid, prompt + ref, sampling)
    ranks: dict[int, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            for i, lp in enumerate(out.prompt_logprobs):
                ranks[out.prompt_logprobs_start + i] = lp.rank
    return sum(1 for i in range(len(ref)) if ranks.get(len(prompt) + i) == 1)


def compare(ref: Engine, cand: Engine, prompts: list[list[int]], n: int) -> dict[str, Any]:
    rows = []
    for k, prompt in enumerate(prompts):
        ref_tokens, ref_logits = greedy(ref, f"ref{k}", prompt, n)
        cand_tokens, cand_logits = greedy(cand, f"cand{k}", prompt, n)
        same = 0
        while same < n and ref_tokens[same] == cand_tokens[same]:
            same += 1
        shared = min(same + 1, n)  # steps whose contexts were identical
        diff = max(
            float((a - b).abs().max())
            for a, b in zip(ref_logits[:shared], cand_logits[:shared], strict=True)
        )
        scale = max(float(a.abs().max()) for a in ref_logits[:shared])
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "identical": same == n,
                "first_divergence": None if same == n else same,
                "agreement": teacher_forced_hits(cand, f"tf{k}", prompt, ref_tokens) / n,
                "max_logit_diff": diff,
                "max_abs_logit": scale,
            }
        )
    return {
        "prompts": len(rows),
        "tokens_per_prompt": n,
        "identical": sum(r["identical"] for r in rows),
        "agreement": sum(r["agreement"] for r in rows) / len(rows),
        "max_logit_diff": max(r["max_logit_diff"] for r in rows),
        "max_abs_logit": max(r["max_abs_logit"] for r in rows),
        "rows": rows,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvflow.tools.bench.precision", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", type=Path, help="model directory (default: the default model)")
    p.add_argument("--data-dir", type=Path, help="where the default model is imported (a tmp dir)")
    p.add_argument(
        "--dtype",
        type=_dtypes,
        default=["bfloat16"],
        help="comma-separated, each compared with float32: " + ", ".join(_CANDIDATES),
    )
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help="two prompts, 8 tokens")
    p.add_argument("--json", type=Path, help="write full results here")
    return p


_CANDIDATES = [name for name in PRECISIONS if name != "float32"]


_dtypes = _cli.names_of("dtype", _CANDIDATES)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tokens <= 0:
        raise SystemExit(f"--tokens must be positive, got {args.tokens}")
    n = 8 if args.quick else args.tokens
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvflow-precision-") as tmp:
        model_dir = args.model or ensure_default_model(args.data_dir or Path(tmp))
        config = EngineConfig(block_size=16, num_pages=64, return_logits=True, seed=0)
        ref = Engine.open(model_dir, config)
        texts = PROMPTS[:1] if args.quick else PROMPTS
        prompts = [equivalence_prompt()] + [ref.tokenizer.encode_prompt(t) for t in texts]
        vocab = ref.spec.vocab_size
        prompts = [[t % vocab for t in p] for p in prompts]  # a tiny model's vocabulary
        results = {}
        for dtype in args.dtype:
            cand = Engine.open(model_dir, EngineConfig(**{**vars(config), "dtype": dtype}))
            results[dtype] = compare(ref, cand, prompts, n)
            del cand
        label = model_dir.name
    summary = f"bench_precision {label} " + (
        " | ".join(
            f"{dtype} vs float32: identical {r['identical']}/{r['prompts']} greedy texts of {n} "
            f"tokens, teacher-forced "
            f"top-1 agreement {r['agreement'] * 100:.1f}%, max logit diff "
            f"{r['max_logit_diff']:.3g} (logits up to {r['max_abs_logit']:.3g})"
            for dtype, r in results.items()
        )
    )
    print(summary)
    if args.json:
        meta = run_meta(args)
        payload: dict[str, Any] = {"summary": summary, "meta": meta, "results": results}
        if len(results) == 1:  # the one-dtype layout earlier runs wrote
            payload.update(next(iter(results.values())))
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
