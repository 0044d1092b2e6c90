"""Seeded random-weight demo models written in the Hugging Face layout.

`write_demo_model(out, preset, seed)` writes config.json (LlamaForCausalLM),
model.safetensors and a byte-level tokenizer.json, so a demo model loads through exactly the
same path as a real one. Same (preset, seed) -> byte-identical files.

Presets:
    tiny:  hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, tied embeddings,
           float32 (~40k parameters; for tests).
    small: hidden 1024, 8 layers, 8 heads, 2 KV heads, intermediate 2816, vocab 32000,
           untied, bfloat16 on disk (~156M parameters; for benchmarks and the default server).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvflow.stages.engine.spec import spec_from_config

SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>")
BOS_ID, EOS_ID = 1, 2


@dataclass(frozen=True)
class DemoPreset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str


PRESETS: dict[str, DemoPreset] = {
    "tiny": DemoPreset(64, 2, 4, 2, 128, 320, 4096, True, "float32"),
    "small": DemoPreset(1024, 8, 8, 2, 2816, 32000, 16384, False, "bfloat16"),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _pseudo_word(i: int) -> str:
    """A pronounceable word for id ``i`` (distinct ids give distinct words)."""
    syllables = []
    while True:
        i, r = divmod(i, len(_CONSONANTS) * len(_VOWELS))
        syllables.append(_CONSONANTS[r // len(_VOWELS)] + _VOWELS[r % len(_VOWELS)])
        if i == 0:
            return "".join(syllables)
        i -= 1


def build_tokenizer(vocab_size: int = 0) -> HFTokenizer:
    """Byte-level tokenizer: <unk>=0, <s>=1, </s>=2, then the 256 bytes in byte order.

    Ids from 259 up to ``vocab_size`` (the model's embedding rows) decode to " <word>" pseudo
    words, so whatever a random-weight model samples shows as text; encoding text never
    produces them (there are no merges)."""
    to_unicode = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in sorted(to_unicode.items()):
        vocab[ch] = len(SPECIAL_TOKENS) + b
    space = to_unicode[ord(" ")]
    for i in range(len(vocab), vocab_size):
        vocab[space + _pseudo_word(i)] = i
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def demo_config(preset: DemoPreset) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.hidden_size // preset.num_heads,
        "vocab_size": preset.vocab_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": preset.dtype,
    }


def _random_weights(config: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, Any]:
    from kvflow.stages.engine.model import CausalLM

    spec = spec_from_config(config)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(spec).state_dict().items()}
    if spec.tie_word_embeddings:
        del shapes["lm_head.weight"]
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shapes[name], dtype=dtype)
        else:
            t = torch.empty(shapes[name], dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
            state[name] = t.to(dtype)
    return state


def write_demo_model(out: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a seeded random-weight Llama model to `out` (created if needed; existing demo
    files are overwritten). Returns the directory. Raises ValueError for an unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    p = PRESETS[preset]
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    config = demo_config(p)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[p.dtype]
    state = _random_weights(config, seed, dtype)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    build_tokenizer(p.vocab_size).save(str(path / "tokenizer.json"))
    return path
