"""Corpus items → token ids: prompts through the model's tokenizer, chats through its chat
template, trace hash ids through deterministic token blocks.

``trace_block_tokens`` is the one definition of a trace block's tokens: a replay that builds
its prompts with it (same block size, same vocabulary) hits what a warm-up of the trace put in
the cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.stages.warmup.corpus import CorpusItem

# Token ids below this are left out of trace blocks (special and control tokens sit there in
# every byte-level vocabulary kvflow reads).
TRACE_MIN_TOKEN = 16


class ItemError(ValueError):
    """An item that cannot be turned into tokens (no chat template, a template error...)."""


@dataclass(frozen=True)
class Materializer:
    """``tokenizer`` has ``encode(text, add_special_tokens)`` and ``encode_prompt(text)``;
    ``chat_template`` has ``render(messages, add_generation_prompt=...)`` or is None."""

    tokenizer: Any
    chat_template: Any
    block_size: int
    vocab_size: int

    def tokens(self, item: CorpusItem) -> list[int]:
        """The item's prompt token ids; ItemError when it has none."""
        if item.hash_ids is not None:
            out: list[int] = []
            for h in item.hash_ids:
                out += trace_block_tokens(h, self.block_size, self.vocab_size)
            return out
        if item.messages is not None:
            if self.chat_template is None:
                raise ItemError("the model has no chat template for 'messages'")
            try:
                text = self.chat_template.render(list(item.messages), add_generation_prompt=True)
            except Exception as exc:  # ChatTemplateError and anything the template raises
                raise ItemError(f"chat template: {exc}") from exc
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        assert item.prompt is not None
        return list(self.tokenizer.encode_prompt(item.prompt))


def trace_block_tokens(hash_id: int, block_size: int, vocab_size: int) -> list[int]:
    """``block_size`` token ids for trace block ``hash_id``: seeded by blake2b of the id, so
    the same on every machine and every run."""
    if vocab_size <= TRACE_MIN_TOKEN:
        raise ValueError(f"vocab_size must be > {TRACE_MIN_TOKEN}, got {vocab_size}")
    seed = int.from_bytes(
        hashlib.blake2b(f"kvflow-trace:{hash_id}".encode(), digest_size=8).digest()
    )
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(TRACE_MIN_TOKEN, vocab_size, size=block_size)]
