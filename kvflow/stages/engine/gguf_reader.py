"""Reading a llama.cpp GGUF file (through the `gguf` package) as a Hugging Face checkpoint:
its metadata as a config.json dict and its tensors, dequantized, under HF parameter names.

Only the Llama architecture (`general.architecture == "llama"`, which llama.cpp also uses for
Mistral-style checkpoints) is read. llama.cpp's converter permutes the rows of the query and key
projections for its rotary layout (interleaved pairs instead of two halves);
`unpermute_rows` undoes that exactly as transformers' GGUF loader does.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvflow.stages.engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

ARCHITECTURES: tuple[str, ...] = ("llama",)
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFFile:
    """An opened GGUF file: `metadata` maps every key to its value (arrays as lists; strings
    decoded); `reader` is the `gguf.GGUFReader` (memory-mapped; tensors are read lazily)."""

    path: Path
    metadata: dict[str, Any]
    reader: Any

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, name: str, default: Any = None) -> Any:
        """The value of `<architecture>.<name>`, or `default`."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and parse a GGUF file's header; ModelLoadError if it is missing or not GGUF."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {list(ARCHITECTURES)})"
        )
    return GGUFFile(path, metadata, reader)


def _required(f: GGUFFile, name: str) -> Any:
    value = f.arch_key(name)
    if value is None:
        raise ModelLoadError(f"{f.path}: GGUF metadata has no {f.architecture}.{name}")
    return value


def _rope_scaling(f: GGUFFile) -> dict[str, Any] | None:
    kind = f.arch_key("rope.scaling.type", "none")
    if "rope_freqs.weight" in f.tensor_names:
        raise ModelLoadError(f"{f.path}: llama3-style rope_freqs are not supported")
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_required(f, "rope.scaling.factor"))}
    raise ModelLoadError(f"{f.path}: rope scaling {kind!r} is not supported")


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The config.json a Hugging Face LlamaForCausalLM directory needs for this file."""
    hidden = int(_required(f, "embedding_length"))
    heads = int(_required(f, "attention.head_count"))
    tokens = f.metadata.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_required(f, "feed_forward_length")),
        "num_hidden_layers": int(_required(f, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.arch_key("attention.head_count_kv", heads)),
        "head_dim": int(f.arch_key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(f.arch_key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.arch_key("context_length", 2048)),
        "vocab_size": int(f.arch_key("vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in f.tensor_names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    scaling = _rope_scaling(f)
    if scaling is not None:
        config["rope_scaling"] = scaling
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = f.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key.replace("padding", "pad")] = int(value)
    return config


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k projection `[n_head*head_dim, in]`
    (per head: rows (0, d/2, 1, d/2+1, ...) back to (0, 1, ..., d-1)); the same reshape as
    transformers' `LlamaTensorProcessor._reverse_permute_weights`."""
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def hf_name(name: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None for one we do not load."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def iter_tensors(f: GGUFFile, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) for every weight, dequantized to float32 first and with
    the q/k row permutation undone. One tensor at a time (memory stays one tensor wide).
    ModelLoadError for a tensor that no HF parameter corresponds to."""
    from gguf.quants import dequantize

    config = hf_config(f)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for t in f.reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"{f.path}: unexpected GGUF tensor {t.name!r}")
        try:
            array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{f.path}: cannot dequantize {t.name} ({t.tensor_type.name}): {exc}"
            ) from exc
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest first
        array = array.reshape(shape)
        if name.endswith("q_proj.weight"):
            array = unpermute_rows(array, heads)
        elif name.endswith("k_proj.weight"):
            array = unpermute_rows(array, kv_heads)
        if not array.flags.writeable:  # a float32 tensor is a view of the read-only mmap
            array = array.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
