"""Structured output: a grammar that constrains which tokens a request may sample.

`GrammarSpec` is what a request asks for (a JSON schema, any JSON object, a regex or an EBNF
grammar, as text). `GrammarCompiler` turns it into a compiled grammar for one tokenizer with
xgrammar (what vLLM and SGLang use; CPU-only is fine) and caches it per spec, so a schema is
compiled once per engine; it is thread-safe, so the fronts compile (and so validate) a spec
off the engine thread before the request is queued, and the engine's own compile is a cache
hit. `Constraint` is one request's matcher: it masks a row of logits to the tokens the grammar
allows next and advances with each sampled token; once the grammar is complete only the
stop tokens remain, and the request ends with finish_reason "stop".

xgrammar is an optional dependency (`pip install xgrammar`); without it a request that asks
for a grammar is refused with an error that says so (GrammarError), nothing else changes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.stages.engine.errors import InvalidRequestError

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 65536
"""The longest grammar source a request may carry (characters)."""


class GrammarError(InvalidRequestError):
    """A grammar that cannot be compiled (its message says why), or no grammar engine."""


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output grammar.

    Fields:
        kind: "json_object" (a JSON object, any keys; source ignored), "json_schema" (source: a JSON
            schema as text), "regex" (source: a regular expression the whole output matches) or
            "ebnf" (source: an EBNF grammar in xgrammar's / GBNF syntax, rule `root`).
        source: the grammar's text, at most MAX_GRAMMAR_CHARS characters.
    """

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str) or len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"a grammar must be a string of at most {MAX_GRAMMAR_CHARS} chars")
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"a {self.kind} grammar needs its source text")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # an optional dependency
        raise GrammarError(
            "structured output (response_format, regex, json_schema, ebnf) needs the xgrammar "
            "package on the server: pip install xgrammar"
        ) from exc
    return xgrammar


class GrammarCompiler:
    """Compiles GrammarSpecs for one vocabulary; cached per spec. Thread-safe.

    `encoded_vocab[i]` is token i as the tokenizer stores it (tokenizer.json's vocabulary),
    `backend_json` the tokenizer.json text (its decoder says how tokens encode bytes),
    `stop_ids` the tokens that end generation (a complete grammar allows only these)."""

    def __init__(
        self, encoded_vocab: list[str], backend_json: str, vocab_size: int, stop_ids: Iterable[int]
    ) -> None:
        self._vocab = encoded_vocab
        self._backend = backend_json
        self.vocab_size = vocab_size
        self._stop_ids = sorted(set(stop_ids))
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: dict[GrammarSpec, Any] = {}

    @classmethod
    def for_tokenizer(cls, inner: Any, vocab_size: int, stop_ids: Iterable[int]) -> GrammarCompiler:
        """From a `tokenizers.Tokenizer` (the model's tokenizer.json)."""
        vocab = [""] * vocab_size
        for token, idx in inner.get_vocab(with_added_tokens=True).items():
            if 0 <= idx < vocab_size:
                vocab[idx] = token
        return cls(vocab, inner.to_str(), vocab_size, stop_ids)

    def _engine(self) -> Any:
        xgr = _xgrammar()
        with self._lock:
            if self._compiler is None:
                meta = xgr.TokenizerInfo._detect_metadata_from_hf(self._backend)
                info = xgr.TokenizerInfo(
                    self._vocab,
                    vocab_type=meta["vocab_type"],
                    vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_ids or None,
                    add_prefix_space=meta["add_prefix_space"],
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar for `spec` (cached). GrammarError names what is wrong."""
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        compiler = self._engine()
        try:
            # The schema as written (strict_mode off): additional properties are allowed
            # exactly where the schema allows them (OpenAI's strict schemas forbid them).
            if spec.kind == "json_object":  # OpenAI's json_object: an object, not any value
                compiled = compiler.compile_json_schema('{"type": "object"}', strict_mode=False)
            elif spec.kind == "json_schema":
                json.loads(spec.source)  # a clear error for text that is not JSON at all
                compiled = compiler.compile_json_schema(spec.source, strict_mode=False)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.source)
            else:
                compiled = compiler.compile_grammar(spec.source)
        except (ValueError, RuntimeError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GrammarError(f"invalid {spec.kind} grammar: {first[:300]}") from exc
        with self._lock:
            if len(self._cache) >= 256:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = compiled
        return compiled

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh matcher for one request."""
        return Constraint(_xgrammar(), self.compile(spec), self.vocab_size)


class Constraint:
    """One request's grammar state. Not thread-safe (the engine thread owns it)."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())

    def mask(self, row: torch.Tensor) -> torch.Tensor:
        """A copy of the float32 logits `row` [vocab] with disallowed tokens at -inf."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        out = row[None, :].clone()
        self._xgr.apply_token_bitmask_inplace(out, self._bitmask, vocab_size=self._vocab_size)
        return out[0]

    def accept(self, token: int) -> bool:
        """Advance over a sampled (or already generated) token; False if the grammar refuses
        it (the matcher is unchanged then)."""
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(int(token)))
