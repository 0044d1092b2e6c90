"""Warm-up corpora: the input formats, parsed into items (or per-line errors).

Formats (``fmt``):

- ``prompts``: JSONL, one ``{"prompt": str}`` (or ``{"text": str}``) per line;
- ``chat``: JSONL, one ``{"messages": [{"role", "content"}, ...]}`` per line, rendered later
  with the model's chat template;
- ``openai-batch``: OpenAI batch-request lines, ``{"custom_id", "method", "url", "body":
  {"messages": [...]} | {"prompt": str}}``;
- ``trace``: a Mooncake-format trace, one ``{"timestamp", "input_length", "output_length",
  "hash_ids": [int, ...]}`` per line; each hash id becomes one deterministic token block;
- ``text``: each file is one prompt (plain text files, or a directory of them);
- ``auto``: ``.txt``/``.md`` files (or files that are not JSON lines) are ``text``; each JSON
  line is read by the keys it has.

A malformed line is a ``CorpusError`` with its file and 1-based line number; the rest of the
corpus is still parsed. Pure functions: no I/O (the caller reads the files).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FORMATS = ("auto", "prompts", "chat", "openai-batch", "trace", "text")
TEXT_SUFFIXES = (".txt", ".md", ".text")


@dataclass(frozen=True)
class CorpusFile:
    """One input file: its name (for error messages) and its bytes."""

    name: str
    content: bytes


@dataclass(frozen=True)
class CorpusItem:
    """One prompt to warm. Exactly one of ``prompt``, ``messages``, ``hash_ids`` is set.
    ``line`` is the 1-based line in ``source`` (0 for a whole text file)."""

    index: int
    source: str
    line: int
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    label: str = ""

    @property
    def kind(self) -> str:
        if self.messages is not None:
            return "chat"
        if self.hash_ids is not None:
            return "trace"
        return "prompt"

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"index": self.index, "source": self.source, "line": self.line}
        if self.label:
            doc["label"] = self.label
        if self.prompt is not None:
            doc["prompt"] = self.prompt
        if self.messages is not None:
            doc["messages"] = list(self.messages)
        if self.hash_ids is not None:
            doc["hash_ids"] = list(self.hash_ids)
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> CorpusItem:
        messages = doc.get("messages")
        hash_ids = doc.get("hash_ids")
        return cls(
            index=int(doc["index"]),
            source=str(doc["source"]),
            line=int(doc["line"]),
            prompt=doc.get("prompt"),
            messages=None if messages is None else tuple(messages),
            hash_ids=None if hash_ids is None else tuple(int(h) for h in hash_ids),
            label=str(doc.get("label", "")),
        )


@dataclass(frozen=True)
class CorpusError:
    """A line (or file) that could not be read; ``line`` 0 means the whole file."""

    source: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.message}"


class _BadLine(ValueError):
    pass


def parse_corpus(
    files: list[CorpusFile], fmt: str = "auto"
) -> tuple[list[CorpusItem], list[CorpusError]]:
    """Every item of ``files`` in order, and every error. Raises ValueError for an unknown
    ``fmt`` only; an empty corpus is an empty list (the caller decides)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    items: list[CorpusItem] = []
    errors: list[CorpusError] = []
    for f in files:
        try:
            text = f.content.decode("utf-8")
        except UnicodeDecodeError as exc:
            errors.append(CorpusError(f.name, 0, f"not UTF-8 text: {exc}"))
            continue
        if fmt == "text" or (fmt == "auto" and _looks_like_text(f.name, text)):
            if text.strip():
                items.append(CorpusItem(len(items), f.name, 0, prompt=text, label=f.name))
            else:
                errors.append(CorpusError(f.name, 0, "empty text file"))
            continue
        for number, raw in enumerate(text.splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                item = _parse_line(raw, fmt, len(items), f.name, number)
            except _BadLine as exc:
                errors.append(CorpusError(f.name, number, str(exc)))
                continue
            items.append(item)
    return items, errors


def _looks_like_text(name: str, text: str) -> bool:
    if name.lower().endswith(TEXT_SUFFIXES):
        return True
    first = next((line for line in text.splitlines() if line.strip()), "")
    return not first.lstrip().startswith("{")


def _parse_line(raw: str, fmt: str, index: int, source: str, line: int) -> CorpusItem:
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _BadLine(f"not JSON: {exc.msg} (column {exc.colno})") from exc
    if not isinstance(doc, dict):
        raise _BadLine("a line must be a JSON object")
    if fmt == "auto":
        fmt = _detect(doc)
    base = {"index": index, "source": source, "line": line}
    if fmt == "prompts":
        return CorpusItem(**base, prompt=_prompt(doc), label=_label(doc))
    if fmt == "chat":
        return CorpusItem(**base, messages=_messages(doc), label=_label(doc))
    if fmt == "openai-batch":
        body = doc.get("body")
        if not isinstance(body, dict):
            raise _BadLine("an OpenAI batch line needs a 'body' object")
        label = str(doc.get("custom_id", ""))
        if "messages" in body:
            return CorpusItem(**base, messages=_messages(body), label=label)
        return CorpusItem(**base, prompt=_prompt(body), label=label)
    return CorpusItem(**base, hash_ids=_hash_ids(doc), label=_label(doc))


def _detect(doc: dict[str, Any]) -> str:
    if "hash_ids" in doc:
        return "trace"
    if "body" in doc:
        return "openai-batch"
    if "messages" in doc:
        return "chat"
    if "prompt" in doc or "text" in doc:
        return "prompts"
    raise _BadLine("no 'prompt', 'text', 'messages', 'body' or 'hash_ids' key")


def _label(doc: dict[str, Any]) -> str:
    for key in ("id", "custom_id", "name"):
        if key in doc:
            return str(doc[key])
    return ""


def _prompt(doc: dict[str, Any]) -> str:
    value = doc.get("prompt", doc.get("text"))
    if isinstance(value, list) and len(value) == 1:  # OpenAI completions accept a list
        value = value[0]
    if not isinstance(value, str) or not value:
        raise _BadLine("'prompt' must be a non-empty string")
    return value


def _messages(doc: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadLine("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _BadLine(f"message {i} needs a 'role' string")
        if not isinstance(m.get("content", ""), str | list):
            raise _BadLine(f"message {i}: 'content' must be a string or a list of parts")
    return tuple(messages)


def _hash_ids(doc: dict[str, Any]) -> tuple[int, ...]:
    ids = doc.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise _BadLine("'hash_ids' must be a non-empty list of integers")
    if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
        raise _BadLine("'hash_ids' must hold non-negative integers")
    return tuple(ids)
