"""`kvflow demo-model`: write a seeded random-weight Llama model in the Hugging Face layout."""

from __future__ import annotations

import argparse

from kvflow.stages.engine import PRESETS, write_demo_model
from kvflow.stages.engine.spec import load_spec


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo-model",
        help="write a seeded random-weight model (config.json, model.safetensors, tokenizer.json)",
    )
    parser.add_argument("--out", required=True, help="directory to write (created if needed)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = write_demo_model(args.out, args.preset, args.seed)
    spec, _ = load_spec(path)
    print(
        f"wrote {args.preset} demo model to {path}: {spec.architecture}, "
        f"{spec.num_params / 1e6:.1f}M parameters, seed {args.seed}"
    )
    return 0
