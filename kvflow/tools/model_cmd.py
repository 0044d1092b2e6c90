"""`kvflow model`: model-directory tools. `import-gguf FILE --out DIR [--dtype]` writes a
Hugging Face directory from a llama.cpp GGUF file; `default [--data-dir]` imports (once) and
prints the default model's directory."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvflow.stages.engine import EngineError
from kvflow.stages.engine.default_model import ensure_default_model
from kvflow.stages.engine.gguf_import import import_gguf


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("model", help="model directories: import a GGUF file, the default")
    sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    imp = sub.add_parser("import-gguf", help="write a Hugging Face directory from a GGUF file")
    imp.add_argument("file", type=Path, help="the .gguf file")
    imp.add_argument("--out", type=Path, required=True, help="directory to create (must not exist)")
    imp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    imp.set_defaults(func=run_import)
    default = sub.add_parser("default", help="import the default model (once); print its path")
    default.add_argument("--data-dir", type=Path, default=Path("data"))
    default.set_defaults(func=run_default)


def run_import(args: argparse.Namespace) -> int:
    try:
        result = import_gguf(args.file, args.out, dtype=args.dtype)
    except (EngineError, FileExistsError, ValueError) as exc:
        print(f"kvflow model import-gguf: {exc}")
        return 2
    print(
        f"wrote {result.model_dir}: {result.num_params / 1e6:.1f}M parameters "
        f"({args.dtype}) in {result.seconds:.1f}s"
    )
    return 0


def run_default(args: argparse.Namespace) -> int:
    try:
        path = ensure_default_model(args.data_dir, progress=lambda line: print(line, flush=True))
    except EngineError as exc:
        print(f"kvflow model default: {exc}")
        return 2
    print(path)
    return 0
