"""The model's tokenizer, loaded from tokenizer.json through the `tokenizers` library."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from kvflow.stages.engine.errors import ModelLoadError

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """Text <-> token ids. Thread-safe for encode/decode (the Rust tokenizer is)."""

    def __init__(self, inner: HFTokenizer) -> None:
        self._inner = inner
        self._max_token_chars: int | None = None

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise ModelLoadError(f"model directory {model_dir} has no {TOKENIZER_FILE}")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ModelLoadError(f"cannot load {path}: {exc}") from exc

    @property
    def inner(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (read-only use: its vocabulary)."""
        return self._inner

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce (including added special tokens)."""
        return int(self._inner.get_vocab_size(with_added_tokens=True))

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token covers (its longest vocabulary
        string): a text of n characters has at least ceil(n / max_token_chars) tokens, which
        lets a front refuse an over-long prompt without tokenizing it."""
        if self._max_token_chars is None:
            vocab = self._inner.get_vocab(with_added_tokens=True)
            self._max_token_chars = max((len(t) for t in vocab), default=1) or 1
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; no BOS unless add_special_tokens and the tokenizer adds one."""
        return list(self._inner.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw text prompt, with the special tokens the tokenizer adds to a
        sequence (BOS for Llama and Mistral tokenizers; none for byte-level GPT-2 style ones),
        as transformers' `tokenizer(text)` does. A rendered chat template already holds its
        special tokens as text: encode it with `encode(text)` instead."""
        return self.encode(text, add_special_tokens=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._inner.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_stream(self, skip_special_tokens: bool = True) -> TokenStream:
        """A fresh streaming decoder for one sequence of generated ids (linear time)."""
        return TokenStream(self._inner, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._inner.token_to_id(token)


class TokenStream:
    """Streaming detokenization of one sequence through tokenizers' DecodeStream: each id
    costs a decode of a few ids, never of the whole text. Text comes out in whole
    characters only: an id that ends inside a multi-byte UTF-8 character yields "" until the
    character completes (an invalid byte followed by more text comes out as U+FFFD with that
    text, as DecodeStream does). `flush()` gives what is still held at the end of the
    sequence: the bytes of a truncated or invalid trailing character decode to U+FFFD, as
    `Tokenizer.decode` would, instead of vanishing. Not thread-safe (one per request)."""

    def __init__(self, inner: HFTokenizer, skip_special_tokens: bool) -> None:
        self._inner = inner
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._context: list[int] = []  # the ids of the last text given out (decode context)
        self._held: list[int] = []  # ids stepped since then, their text not yet given out

    def step(self, token_id: int) -> str:
        """The text that `token_id` completes ("" when none yet)."""
        token_id = int(token_id)
        self._held.append(token_id)
        text = self._stream.step(self._inner, token_id) or ""
        if text:
            self._context, self._held = self._held, []
        return text

    def flush(self) -> str:
        """The text of the ids still held (U+FFFD for bytes that form no character), then
        "" until more ids are stepped. Decoded after the last given-out ids, so a decoder
        that treats the first token of a text specially (a leading space) sees the same
        context DecodeStream did."""
        if not self._held:
            return ""
        skip = self._skip_special_tokens
        prefix = self._inner.decode(self._context, skip_special_tokens=skip)
        full = self._inner.decode(self._context + self._held, skip_special_tokens=skip)
        text = (
            full[len(prefix) :]
            if full.startswith(prefix)
            else self._inner.decode(self._held, skip_special_tokens=skip)
        )
        self._context, self._held = self._held, []
        self._stream = DecodeStream(skip_special_tokens=skip)  # its held ids are given out
        return str(text)
