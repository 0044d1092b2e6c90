"""Roofline benchmark: the engine's prefill and decode on the default model against what this
machine can do with the same torch and thread count.

Measures, best of `--repeat`:
- the matmul rate: FLOP/s of `torch.mm` over one layer's seven projection shapes (q, k, v, o,
  gate, up, down) at the prefill's rows (min(prompt, prefill chunk)), in the engine's dtype,
  on the same thread with the same thread count, measured next to each prefill timing;
- the memory bandwidth: bytes/s of `sum` over a `--bw-mib` MiB tensor (a read stream);
- prefill tokens/s at each `--prefill-lens` length (time to the first token of a fresh
  request), with the FLOP/s it implies (2 x parameters per token, attention ignored) as a share
  of the matmul rate;
- decode tokens/s at each `--decode-batches` batch size after a `--decode-context`-token
  prompt; at batch 1 against the bandwidth ceiling: bandwidth / bytes of the weights in the
  engine's dtype (every weight is read once per step; tied embeddings count once).

`--dtype float32,bfloat16,int8,int4` runs an engine per dtype (int8/int4: weight-only
quantized decoder linears with bf16 activations, whose matmul rate is measured in bf16 and
whose ceiling counts the int8/int4 weights and their scales); the model loads with
q/k/v and gate/up fused (the engine's default; `--fused` says so), `--unfused` loads the
separate projections, and `--compare` runs both layouts;
`--linears onednn,aten` runs an engine per linear backend (`KVFLOW_LINEAR`,
onednn_linear.py); `--elementwise fused,torch` runs each engine with the fused CPU elementwise
kernels and with torch's ops (`KVFLOW_FUSED`, cpu_fused.py; the same engine, switched per
run); `--attention paged,torch` runs each with the paged attention kernels (decode and
prefill) and with torch's attention (`KVFLOW_ATTN`, cpu_attn.py; switched per run, as
`--elementwise`). With more than one engine or setting they run alternating, A B ... B A, in
one invocation, each row the better of its two passes. Seeded; one summary line; `--json PATH`
writes every number.

    python -m kvflow.tools.bench.roofline                  # default model, 2 threads
    python -m kvflow.tools.bench.roofline --dtype float32,bfloat16 --json out.json
    python -m kvflow.tools.bench.roofline --quick --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.stages.engine.cpu_attn import ATTN_SETTINGS, ENV_ATTN
from kvflow.stages.engine.cpu_fused import ENV_FUSED
from kvflow.stages.engine.default_model import ensure_default_model
from kvflow.stages.engine.loader import fingerprint, load_weights
from kvflow.stages.engine.model_card import ModelCard
from kvflow.stages.engine.onednn_linear import ENV_LINEAR, LINEAR_BACKENDS
from kvflow.stages.engine.precision import PRECISIONS
from kvflow.stages.engine.spec import load_spec
from kvflow.stages.engine.tokenizer import Tokenizer
from kvflow.tools.bench import _cli
from kvflow.tools.bench._meta import run_meta


def _best(fn: Any, repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def projection_shapes(spec: Any) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's seven projections, as nn.Linear stores them."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def matmul_flops(
    shapes: list[tuple[int, int]], tokens: int, dtype: torch.dtype, repeat: int
) -> float:
    """FLOP/s of `torch.mm` over `shapes` (a layer's projections) at `tokens` rows in `dtype`:
    what the prefill's matmuls could reach on this thread with this thread count."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(dtype) for o, i in shapes]
    inputs = {i: torch.randn(tokens, i, generator=gen).to(dtype) for _, i in shapes}

    def once() -> float:
        start = time.perf_counter()
        for w in weights:
            torch.mm(inputs[w.shape[1]], w.t())
        return time.perf_counter() - start

    once()
    return 2.0 * tokens * sum(o * i for o, i in shapes) / _best(once, repeat)


def read_bandwidth(mib: int, repeat: int) -> float:
    """Bytes/s of summing a float32 tensor of `mib` MiB (larger than any cache)."""
    x = torch.ones(mib * (1 << 20) // 4)
    x.sum()

    def once() -> float:
        start = time.perf_counter()
        x.sum()
        return time.perf_counter() - start

    return x.numel() * 4 / _best(once, repeat)


def open_engine(
    model_dir: Path, config: EngineConfig, fuse: bool, linears: str | None = None
) -> Engine:
    """Engine.open, with the projection fusion and the linear backend selectable (the bench's
    A/B switches; `linears` None: the environment's)."""
    spec, config_bytes = load_spec(model_dir)
    card = ModelCard.from_dir(model_dir)
    device = torch.device(config.device)
    saved = os.environ.get(ENV_LINEAR)
    if linears is not None:
        os.environ[ENV_LINEAR] = linears
    try:
        model = load_weights(model_dir, spec, config.torch_dtype, device, fuse, config.precision)
    finally:
        if saved is None:
            os.environ.pop(ENV_LINEAR, None)
        else:
            os.environ[ENV_LINEAR] = saved
    fp = fingerprint(model_dir, config_bytes, config.dtype)
    return Engine(model, Tokenizer.from_dir(model_dir), config, fp, card)


ELEMENTWISE = {"fused": "1", "torch": "0"}
"""`--elementwise` names and the `KVFLOW_FUSED` value each runs under."""


def bench_with(
    engine: Engine,
    elementwise: str | None,
    attention: str | None,
    args: argparse.Namespace,
    bandwidth: float,
) -> dict:
    """`bench_engine` with `KVFLOW_FUSED` set for `elementwise` and `KVFLOW_ATTN` for
    `attention` (None: the environment's), restored after."""
    wanted = {ENV_FUSED: None if elementwise is None else ELEMENTWISE[elementwise]}
    wanted[ENV_ATTN] = attention
    saved = {name: os.environ.get(name) for name in wanted}
    for name, value in wanted.items():
        if value is not None:
            os.environ[name] = value
    try:
        return bench_engine(engine, args, bandwidth)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def weight_bytes(engine: Engine) -> int:
    """Bytes of the weights one decode step reads: every parameter, oneDNN-prepared linear
    weight (`packed` buffers, opaque tensors without a storage) and int8/int4 weight with its
    scales (`packed`, `scales` buffers), each once; the embedding table only where it is the
    lm_head's weight (tied), as a step reads one row."""
    model = engine.model
    embed = model.model.embed_tokens.weight
    lm_head = getattr(model.lm_head, "weight", None)
    tensors = [p for p in model.parameters() if p is not embed or p is lm_head]
    tensors += [b for n, b in model.named_buffers() if n.endswith(("packed", "scales"))]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        key = t.data_ptr() if t.layout == torch.strided else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def prefill_s(engine: Engine, n: int, seed: int) -> float:
    prompt = _prompt(n, seed, engine.spec.vocab_size)
    engine.add_request(f"p{seed}-{n}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def decode_tokens(batch: int, context: int, steps: int, prefill_chunk: int) -> int:
    """A decode request's token budget in `decode_tok_s`: a token a step while the batch's
    prompts are computed (at most one step a chunk, and one a prompt), then ``steps``."""
    return -(-batch * context // prefill_chunk) + batch + steps + 1


def decode_tok_s(engine: Engine, batch: int, context: int, steps: int, seed: int) -> float:
    """Tokens per second of ``steps`` decode steps of ``batch`` requests of ``context``
    prompt tokens each, timed once every prompt is computed. The early prompts decode
    while the later ones prefill (untimed), so each may decode a step per prefill step
    before the timed ones: its token budget covers both."""
    sampling = SamplingParams(
        max_tokens=decode_tokens(batch, context, steps, engine.config.prefill_chunk),
        ignore_eos=True,
    )
    ids = [f"d{seed}-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, _prompt(context, seed * 1000 + i, engine.spec.vocab_size), sampling)
    while any(engine.num_computed_tokens(rid) < context for rid in ids):
        engine.step()  # prefills (and the first tokens), untimed
    before = sum(len(engine.token_ids(rid)) for rid in ids)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    made = sum(len(engine.token_ids(rid)) for rid in ids) - before
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return made / elapsed


def bench_engine(engine: Engine, args: argparse.Namespace, bandwidth: float) -> dict:
    spec = engine.spec  # matmul FLOPs per prompt token: every weight but the embeddings
    flops_per_token = 2.0 * (spec.num_params - spec.vocab_size * spec.hidden_size)
    shapes = projection_shapes(spec)
    out: dict[str, Any] = {
        "dtype": engine.config.dtype,
        "weight_bytes": weight_bytes(engine),
        "prefill": [],
        "decode": [],
    }
    for n in args.prefill_lens:
        rows = min(n, engine.config.prefill_chunk)
        s, mm = float("inf"), 0.0
        for _ in range(args.repeat):  # the reference next to each timing: the same load
            mm = max(mm, matmul_flops(shapes, rows, engine.config.torch_dtype, 1))
            s = min(s, prefill_s(engine, n, args.seed))
        rate = n * flops_per_token / s
        out["prefill"].append(
            {
                "tokens": n,
                "seconds": s,
                "tok_s": n / s,
                "flops": rate,
                "mm_rows": rows,
                "mm_flops": mm,
                "matmul_share": rate / mm,
            }
        )
    ceiling = bandwidth / out["weight_bytes"]
    for b in args.decode_batches:
        tps = max(
            decode_tok_s(engine, b, args.decode_context, args.decode_steps, args.seed + r)
            for r in range(args.repeat)
        )
        row = {"batch": b, "tok_s": tps}
        if b == 1:
            row["ceiling_tok_s"] = ceiling
            row["ceiling_share"] = tps / ceiling
        out["decode"].append(row)
    return out


def _summary(label: str, bandwidth: float, runs: dict[str, dict]) -> str:
    parts = [f"bench_roofline {label}: read {bandwidth / 1e9:.1f} GB/s"]
    for name, r in runs.items():
        pre = " ".join(
            f"p{p['tokens']}={p['tok_s']:.0f}tok/s({p['matmul_share'] * 100:.0f}% of "
            f"mm {p['mm_flops'] / 1e9:.0f} GFLOP/s)"
            for p in r["prefill"]
        )
        dec = " ".join(
            f"b{d['batch']}={d['tok_s']:.1f}"
            + (
                f"({d['ceiling_share'] * 100:.0f}% of {d['ceiling_tok_s']:.0f})"
                if "ceiling_share" in d
                else ""
            )
            for d in r["decode"]
        )
        parts.append(f"{name}: {pre} decode {dec} tok/s")
    return " | ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvflow.tools.bench.roofline", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", type=Path, help="model directory (default: the default model)")
    p.add_argument("--data-dir", type=Path, help="where the default model is imported (a tmp dir)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument(
        "--prefill-lens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048]
    )
    p.add_argument(
        "--decode-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8]
    )
    p.add_argument("--decode-context", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument(
        "--dtype",
        type=_dtypes,
        default=["float32"],
        help="engine dtype(s), comma-separated: " + ", ".join(PRECISIONS),
    )
    p.add_argument(
        "--linears",
        type=_linears,
        default=None,
        help="linear backend(s), comma-separated: "
        + ", ".join(LINEAR_BACKENDS)
        + " (default: the environment's)",
    )
    p.add_argument(
        "--elementwise",
        type=_elementwise,
        default=None,
        help="elementwise ops, comma-separated: fused (the CPU kernels), torch"
        " (default: the environment's KVFLOW_FUSED)",
    )
    p.add_argument(
        "--attention",
        type=_attention,
        default=None,
        help="attention, comma-separated: paged (the CPU decode and prefill kernels), torch"
        " (default: the environment's KVFLOW_ATTN)",
    )
    p.add_argument("--bw-mib", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3, help="best of this many timings")
    p.add_argument("--seed", type=int, default=0)
    layout = p.add_mutually_exclusive_group()
    layout.add_argument("--fused", action="store_true", help="q/k/v and gate/up fused (default)")
    layout.add_argument("--unfused", action="store_true", help="separate q/k/v and gate/up")
    layout.add_argument("--compare", action="store_true", help="fused and unfused, alternating")
    p.add_argument("--quick", action="store_true", help="short sequences, one repeat")
    p.add_argument("--json", type=Path, help="write full results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.prefill_lens, args.decode_batches = [64], [1, 2]
        args.decode_context, args.decode_steps, args.repeat = 32, 4, 1
        args.bw_mib = 64
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvflow-roofline-") as tmp:
        model_dir = args.model or ensure_default_model(args.data_dir or Path(tmp))
        batch = max(args.decode_batches)
        chunk = EngineConfig().prefill_chunk
        decoded = decode_tokens(batch, args.decode_context, args.decode_steps, chunk)
        longest = max(*args.prefill_lens, args.decode_context + decoded)
        config = EngineConfig(
            num_pages=(batch + 1) * -(-longest // EngineConfig().block_size) + 4,
            max_batch=batch,
            seed=args.seed,
        )
        layouts = {"fused": True, "unfused": False}
        if not args.compare:
            layouts = {"unfused": False} if args.unfused else {"fused": True}
        backends: list[str | None] = args.linears or [None]
        opened = {
            f"{name}-{dtype}" + (f"-{lin}" if lin else ""): open_engine(
                model_dir, replace(config, dtype=dtype), fuse, lin
            )
            for name, fuse in layouts.items()
            for dtype in args.dtype
            for lin in backends
        }
        settings: list[str | None] = args.elementwise or [None]
        attentions: list[str | None] = args.attention or [None]
        engines = {
            name + (f"-{ew}" if ew else "") + (f"-{at}" if at else ""): (engine, ew, at)
            for name, engine in opened.items()
            for ew in settings
            for at in attentions
        }
        bandwidth = read_bandwidth(args.bw_mib, args.repeat)
        for engine in opened.values():  # warm-up: first-touch of pages and weights
            prefill_s(engine, min(64, longest), args.seed + 99)
        runs = {n: bench_with(*engines[n], args, bandwidth) for n in engines}
        if len(engines) > 1:  # second pass in the other order: A B B A
            again = {n: bench_with(*engines[n], args, bandwidth) for n in reversed(list(engines))}
            runs = {n: _better(runs[n], again[n]) for n in runs}
        label = model_dir.name
    summary = _summary(label, bandwidth, runs)
    print(summary)
    if args.json:
        meta = run_meta(args)
        payload = {"summary": summary, "meta": meta, "bandwidth": bandwidth, "runs": runs}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


_dtypes = _cli.names_of("dtype", PRECISIONS)
_linears = _cli.names_of("linear backend", LINEAR_BACKENDS)
_elementwise = _cli.names_of("elementwise setting", tuple(ELEMENTWISE))
_attention = _cli.names_of("attention setting", ATTN_SETTINGS)


def _better(a: dict, b: dict) -> dict:
    """Per row, the faster of two passes over the same layout."""
    out = dict(a)
    out["prefill"] = [
        x if x["tok_s"] >= y["tok_s"] else y
        for x, y in zip(a["prefill"], b["prefill"], strict=True)
    ]
    out["decode"] = [
        x if x["tok_s"] >= y["tok_s"] else y for x, y in zip(a["decode"], b["decode"], strict=True)
    ]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
