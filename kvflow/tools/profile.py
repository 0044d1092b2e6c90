"""`kvflow profile --model DIR`: time the engine and store the conductor's fitted time models
as DIR/kvflow_profile.json (read by `kvflow serve` for the same model and dtype)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvflow.stages.engine import Engine, EngineConfig, ModelLoadError
from kvflow.stages.serve.config import DTYPES
from kvflow.tools.profiling import ProfileGrid, profile_engine


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="fit the conductor's prefill/decode time models")
    p.add_argument("--model", type=Path, required=True, help="model directory")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--max-len", type=int, default=4096, help="longest prompt timed")
    p.add_argument("--quick", action="store_true", help="a small grid (tests, smoke runs)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def grid_for(args: argparse.Namespace) -> ProfileGrid:
    if args.quick:
        return ProfileGrid(
            prompt_lens=(64, 128, 256),
            reuse_fractions=(0.0, 0.5),
            decode_batches=(1, 4),
            decode_contexts=(64, 128),
            decode_steps=4,
            seed=args.seed,
        )
    lens = tuple(n for n in (256, 512, 1024, 2048, 4096, 8192) if n <= args.max_len)
    return ProfileGrid(prompt_lens=lens or (args.max_len,), seed=args.seed)


def run(args: argparse.Namespace) -> int:
    grid = grid_for(args)
    pages = max(
        64,
        (max(grid.prompt_lens) // args.block_size + 2) * 2,
        # decode: context + what early requests decode while later ones prefill
        max(grid.decode_batches)
        * ((max(grid.decode_contexts) * 2 + args.prefill_chunk) // args.block_size + 2),
    )
    try:
        engine = Engine.open(
            args.model,
            EngineConfig(
                dtype=args.dtype,
                block_size=args.block_size,
                num_pages=pages,
                prefill_chunk=args.prefill_chunk,
                seed=args.seed,
            ),
        )
    except (ModelLoadError, ValueError) as exc:
        print(f"kvflow profile: {exc}")
        return 2
    profile = profile_engine(engine, grid, progress=print)
    path = profile.save(args.model)
    summary = {
        "profile": str(path),
        "prefill_coefficients": list(profile.prefill.coefficients),
        "decode_coefficients": list(profile.decode.coefficients),
        "predicted_cold_prefill_s": {
            n: round(profile.prefill.predict(n, 0), 4) for n in grid.prompt_lens
        },
    }
    print(json.dumps(summary))
    return 0
