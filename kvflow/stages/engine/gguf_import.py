"""Importing a GGUF file into a Hugging Face model directory that `Engine.open` (and
transformers) can load: config.json, model.safetensors (dequantized), tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json.

The directory is written under a temporary name and renamed into place, so a crash never
leaves a half-written model where a later run would take it for a complete one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvflow.stages.engine.config import DTYPES
from kvflow.stages.engine.errors import ModelLoadError
from kvflow.stages.engine.gguf_reader import hf_config, iter_tensors, open_gguf
from kvflow.stages.engine.gguf_tokenizer import (
    build_tokenizer,
    generation_config,
    tokenizer_config,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImportResult:
    """What `import_gguf` wrote: the directory, its parameter count and the seconds it took."""

    model_dir: Path
    num_params: int
    seconds: float


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def import_gguf(gguf_path: str | Path, out: str | Path, dtype: str = "float32") -> ImportResult:
    """Read `gguf_path` and write a Hugging Face directory at `out` (which must not exist).

    Weights are dequantized to float32 and stored in `dtype` ("float32", "bfloat16" or
    "float16"); with tied embeddings there is no lm_head in the file, as transformers writes
    it. Raises ModelLoadError for an unreadable or unsupported file, FileExistsError if `out`
    exists, ValueError for an unknown dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    start = time.perf_counter()
    f = open_gguf(gguf_path)
    config = {**hf_config(f), "torch_dtype": dtype}
    tokenizer = build_tokenizer(f)  # before the heavy part: fail fast on a bad vocabulary
    state: dict[str, torch.Tensor] = {}
    for name, tensor in iter_tensors(f, DTYPES[dtype]):
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        state[name] = tensor
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_json(tmp / "config.json", config)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(f))
        _write_json(tmp / "generation_config.json", generation_config(f))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(t.numel() for t in state.values())
    seconds = time.perf_counter() - start
    logger.info("imported %s -> %s: %d params in %.1fs", gguf_path, out, n, seconds)
    return ImportResult(out, n, seconds)


def gguf_hint(path: Path) -> ModelLoadError:
    """The error `Engine.open` raises for a .gguf file: what to run instead."""
    return ModelLoadError(
        f"{path} is a GGUF file, not a model directory; import it first: "
        f"kvflow model import-gguf {path} --out DIR, then use DIR"
    )
