"""Engine benchmark: prefill, prefix reuse and decode on a demo model, against a plain forward.

Measures, for each dtype: prefill tokens/s at several lengths through the engine (paged KV,
chunked prefill) and through one plain forward of the same model with a contiguous KV; the
prefill time of N tokens with P of them imported from exported pages; decode tokens/s at
several batch sizes (and at batch 1 with the plain contiguous KV). Seeded; prints one summary
line; `--json PATH` writes every number.

    python -m kvflow.tools.bench.engine              # the full matrix on the small preset
    python -m kvflow.tools.bench.engine --quick      # seconds, on the tiny preset
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvflow.stages.engine import Engine, EngineConfig, SamplingParams, write_demo_model
from kvflow.stages.engine.attention import ContiguousKV
from kvflow.tools.bench._meta import run_meta

ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, min(vocab, 259), (n,), generator=gen)]


def _run_to_end(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer read after it counts that work (CUDA runs
    asynchronously; the CPU needs nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_prefill(engine: Engine, tokens: list[int], prefix: list[bytes], n_prefix: int) -> float:
    """Seconds from add_request (page import included) to the first sampled token."""
    _sync(engine.device)
    start = time.perf_counter()
    engine.add_request("bench", tokens, ONE_TOKEN, prefix_pages=prefix, num_prefix_tokens=n_prefix)
    _run_to_end(engine)
    return time.perf_counter() - start


@torch.inference_mode()
def time_plain_prefill(engine: Engine, tokens: list[int]) -> float:
    """One forward over the whole sequence with a contiguous KV, plus last-token logits."""
    spec = engine.spec
    _sync(engine.device)
    start = time.perf_counter()
    kv = ContiguousKV(
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        len(tokens),
        engine.page_dtype,
        engine.device,
        spec.sliding_window,
    )
    kv.advance(0, len(tokens))
    ids = torch.tensor(tokens, device=engine.device)
    hidden = engine.model(ids, torch.arange(len(tokens), device=engine.device), kv)
    engine.model.logits(hidden[-1:]).argmax()
    _sync(engine.device)
    return time.perf_counter() - start


@torch.inference_mode()
def time_plain_decode(engine: Engine, context: int, steps: int) -> float:
    """Seconds for `steps` single-token forwards after a `context`-token prefill (untimed)."""
    spec = engine.spec
    kv = ContiguousKV(
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        context + steps,
        engine.page_dtype,
        engine.device,
        spec.sliding_window,
    )
    kv.advance(0, context)
    ids = torch.tensor(_tokens(context, spec.vocab_size, 9), device=engine.device)
    hidden = engine.model(ids, torch.arange(context, device=engine.device), kv)
    token = engine.model.logits(hidden[-1:]).argmax(-1)
    _sync(engine.device)
    start = time.perf_counter()
    for i in range(steps):
        kv.advance(context + i, 1)
        pos = torch.tensor([context + i], device=engine.device)
        token = engine.model.logits(engine.model(token, pos, kv)).argmax(-1)
    _sync(engine.device)
    return time.perf_counter() - start


def _exported(engine: Engine, tokens: list[int], n_prefix: int) -> list[bytes]:
    engine.add_request("src", tokens, ONE_TOKEN, retain_pages=True)
    _run_to_end(engine)
    pages = [engine.export_page_bytes("src", i) for i in range(-(-n_prefix // engine.block_size))]
    engine.release("src")
    return pages


def time_decode(engine: Engine, batch: int, context: int, steps: int) -> float:
    """Seconds for `steps` decode steps of `batch` requests whose `context`-token prompts are
    imported (no prefill is timed)."""
    prompt = _tokens(context, engine.spec.vocab_size, 7)
    pages = _exported(engine, prompt, context - 1)
    sampling = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"d{i}", prompt, sampling, prefix_pages=pages, num_prefix_tokens=context - 1
        )
    engine.step()  # the last prompt token of every request: the first decode batch
    _sync(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine.device)
    elapsed = time.perf_counter() - start
    _run_to_end(engine)
    return elapsed


def bench_dtype(
    model_dir: Path, dtype: str, args: argparse.Namespace, decode_graphs: str = "auto"
) -> dict[str, Any]:
    longest = max([*args.prefill_lens, args.reuse_n, args.decode_context + args.decode_steps + 2])
    block = args.block_size
    pages = max(
        -(-longest // block) * 2 + 8,
        max(args.decode_batches) * (-(-(args.decode_context + args.decode_steps + 1) // block)) + 8,
    )
    config = EngineConfig(
        dtype=dtype,
        block_size=block,
        num_pages=pages,
        prefill_chunk=args.prefill_chunk,
        max_batch=max(args.decode_batches),
        seed=args.seed,
        device=args.device,
        decode_graphs=decode_graphs,
    )
    engine = Engine.open(model_dir, config)
    vocab = engine.spec.vocab_size
    time_prefill(engine, _tokens(min(256, longest), vocab, 0), [], 0)  # warm-up
    time_plain_prefill(engine, _tokens(min(256, longest), vocab, 0))
    out: dict[str, Any] = {
        "dtype": dtype,
        "decode_graphs": decode_graphs,
        "num_pages": pages,
        "prefill": [],
        "reuse": [],
        "decode": [],
    }
    for n in args.prefill_lens:
        tokens = _tokens(n, vocab, n)
        paged = min(time_prefill(engine, tokens, [], 0) for _ in range(args.repeat))
        plain = min(time_plain_prefill(engine, tokens) for _ in range(args.repeat))
        out["prefill"].append(
            {
                "tokens": n,
                "paged_s": paged,
                "plain_s": plain,
                "paged_tok_s": n / paged,
                "plain_tok_s": n / plain,
                "overhead": paged / plain - 1.0,
            }
        )
        logging.info("%s prefill %d: paged %.3fs plain %.3fs", dtype, n, paged, plain)
    tokens = _tokens(args.reuse_n, vocab, 1)
    all_pages = _exported(engine, tokens, max(args.reuse_p))
    for p in args.reuse_p:
        prefix = all_pages[: -(-p // block)]
        t = min(time_prefill(engine, tokens, prefix, p) for _ in range(args.repeat))
        out["reuse"].append({"tokens": args.reuse_n, "imported": p, "seconds": t})
        logging.info("%s reuse N=%d P=%d: %.3fs", dtype, args.reuse_n, p, t)
    cold = next((r["seconds"] for r in out["reuse"] if r["imported"] == 0), None)
    for r in out["reuse"]:
        r["fraction_of_cold"] = None if cold is None else r["seconds"] / cold
    time_decode(engine, 1, args.decode_context, 2)  # warm-up: the decode kernels' first use
    time_plain_decode(engine, args.decode_context, 2)
    for b in args.decode_batches:
        t = time_decode(engine, b, args.decode_context, args.decode_steps)
        out["decode"].append(
            {
                "batch": b,
                "context": args.decode_context,
                "steps": args.decode_steps,
                "seconds": t,
                "tok_s": b * args.decode_steps / t,
            }
        )
        logging.info("%s decode batch %d: %.1f tok/s", dtype, b, b * args.decode_steps / t)
    t = time_plain_decode(engine, args.decode_context, args.decode_steps)
    out["plain_decode_b1_tok_s"] = args.decode_steps / t
    return out


def _summary(preset: str, results: list[dict[str, Any]]) -> str:
    parts = []
    for r in results:
        big = r["prefill"][-1]
        # The reuse point closest to 95% imported (the N=8192, P=7782 target).
        reuse = min(r["reuse"], key=lambda x: abs(x["imported"] / x["tokens"] - 0.95))
        dec = {d["batch"]: d["tok_s"] for d in r["decode"]}
        graphs = "" if r["decode_graphs"] == "auto" else f" graphs={r['decode_graphs']}"
        parts.append(
            f"{r['dtype']}{graphs}: prefill {big['tokens']} {big['paged_tok_s']:.0f} tok/s "
            f"(plain {big['plain_tok_s']:.0f}, overhead {big['overhead'] * 100:+.1f}%), "
            f"reuse P={reuse['imported']}/{reuse['tokens']} "
            f"{(reuse['fraction_of_cold'] or float('nan')) * 100:.1f}% of cold, "
            f"decode " + " ".join(f"b{b}={v:.0f}" for b, v in dec.items()) + " tok/s"
        )
    return f"bench_engine {preset}: " + " | ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvflow.tools.bench.engine", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", type=Path, help="model directory (default: write the demo preset)")
    p.add_argument("--preset", choices=["tiny", "small"], default="small")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prefill-lens", type=_ints, default=[512, 2048, 8192])
    p.add_argument("--reuse-n", type=int, default=8192)
    p.add_argument("--reuse-p", type=_ints, default=[0, 4096, 7782, 8128])
    p.add_argument("--decode-batches", type=_ints, default=[1, 8, 32])
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--repeat", type=int, default=1, help="best of this many timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help='torch device: "cpu" or "cuda[:N]"')
    p.add_argument(
        "--decode-graphs",
        default="auto",
        help='comma list of EngineConfig.decode_graphs modes to run each dtype with ("auto", '
        '"off", "static"; "off,auto" on a GPU compares eager decode with CUDA graphs)',
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny preset, fp32, short sequences: a smoke run in seconds",
    )
    p.add_argument("--json", type=Path, help="write full results here")
    p.add_argument("-v", "--verbose", action="store_true", help="log each timing to stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.quick:
        args.preset, args.dtypes = "tiny", "float32"
        args.prefill_lens, args.reuse_n, args.reuse_p = [128, 512], 512, [0, 256, 486, 448]
        args.decode_batches, args.decode_context, args.decode_steps = [1, 8], 64, 8
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-") as tmp:
        model_dir = args.model or write_demo_model(Path(tmp) / args.preset, args.preset, args.seed)
        results = [
            bench_dtype(model_dir, d, args, g)
            for d in args.dtypes.split(",")
            if d
            for g in args.decode_graphs.split(",")
            if g
        ]
    name = args.model.name if args.model else args.preset
    summary = _summary(name if args.device == "cpu" else f"{name} on {args.device}", results)
    print(summary)
    if args.json:
        meta = run_meta(args)
        args.json.write_text(
            json.dumps({"summary": summary, "meta": meta, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
