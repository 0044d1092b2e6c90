"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers` tokenizer (tokenizer.json),
plus the tokenizer_config.json and generation_config.json fields its metadata gives.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`, what GPT-2, Llama 3,
Qwen2 and SmolLM use) are rebuilt. The pre-tokenizer follows `tokenizer.ggml.pre` the way
llama.cpp does: "smollm" splits digits one by one before the GPT-2 split (as SmolLM's own
tokenizer.json does), the Llama 3 family uses its regex, anything else the GPT-2 split.
Tokens marked CONTROL become special added tokens, USER_DEFINED ones plain added tokens, so
neither is cut into pieces.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from kvflow.stages.engine.errors import ModelLoadError
from kvflow.stages.engine.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType values
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")


def _pre_tokenizer(pre: str) -> Any:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    if pre in _LLAMA3_PRE:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    if pre not in ("default", "gpt2", ""):
        logger.warning("GGUF pre-tokenizer %r unknown; using the GPT-2 split", pre)
    return byte_level


def _token(meta: dict[str, Any], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta["tokenizer.ggml.tokens"]
    return None if token_id is None else str(tokens[int(token_id)])


def build_tokenizer(f: GGUFFile) -> HFTokenizer:
    """tokenizer.json's content for this file; ModelLoadError for a vocabulary kind that is
    not byte-level BPE or a file without tokens and merges."""
    meta = f.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{f.path}: GGUF tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or not merges:
        raise ModelLoadError(f"{f.path}: GGUF metadata lacks tokenizer tokens or merges")
    vocab = {str(t): i for i, t in enumerate(tokens)}
    pairs = [tuple(str(m).split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    special = [str(t) for t, k in zip(tokens, types, strict=False) if k == CONTROL]
    plain = [str(t) for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain])
    bos = _token(meta, "bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(f: GGUFFile) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by text, BOS/EOS flags and the chat template."""
    meta = f.metadata
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(f.arch_key("context_length", 2048)),
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token = _token(meta, key)
        if token is not None:
            config[name] = token
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return config


def generation_config(f: GGUFFile) -> dict[str, Any]:
    """generation_config.json: BOS, EOS (with the end-of-turn token when it differs) and pad."""
    meta = f.metadata
    config: dict[str, Any] = {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    eos = [
        int(meta[k])
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if meta.get(k) is not None
    ]
    eos = list(dict.fromkeys(eos))
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = int(pad)
    return config
