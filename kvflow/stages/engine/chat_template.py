"""A model directory's chat template, rendered with jinja2 the way transformers'
`apply_chat_template(..., tokenize=False)` renders it: the same sandboxed environment
(trim_blocks, lstrip_blocks, loop controls, a `tojson` that does not escape HTML,
`raise_exception`, `strftime_now`), the special tokens (bos_token, eos_token, ...) as
variables, None-valued message keys dropped, inputs reduced to plain JSON data.

Where the template comes from, first found: `chat_template.jinja` (what transformers 5
writes), then `chat_template` in tokenizer_config.json (a string, or a list of
{"name", "template"} of which "default" is used, "tool_use" when tools are given).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from kvflow.stages.engine.errors import ChatTemplateError, ModelLoadError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _plain(value: Any) -> Any:
    """Only JSON-like data reaches the sandbox (as transformers' `_plain_template_data`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    for kind in (str, bool, int, float):
        if isinstance(value, kind):
            return kind(value)
    return f"<{type(value).__name__}>"


def _compile(source: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ModelLoadError(f"chat template does not compile: {exc}") from exc


class ChatTemplate:
    """A compiled chat template plus the special tokens it sees. Immutable; `render` is
    thread-safe (jinja templates are)."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        named: Mapping[str, str] | None = None,
    ) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source)
        self._named = {name: _compile(src) for name, src in (named or {}).items()}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The directory's template, or None when it has none. ModelLoadError for an
        unreadable tokenizer_config.json or a template that does not compile."""
        model_dir = Path(model_dir)
        config: dict[str, Any] = {}
        config_path = model_dir / TOKENIZER_CONFIG
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc
        tokens = {n: t for n in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(n)))}
        named: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, list):
            named = {str(t["name"]): str(t["template"]) for t in raw if isinstance(t, Mapping)}
            raw = named.get("default")
        file = model_dir / TEMPLATE_FILE
        source = file.read_text() if file.is_file() else raw
        if not isinstance(source, str) or not source:
            return None
        return cls(source, tokens, {k: v for k, v in named.items() if k != "default"})

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages` ([{"role", "content", ...}]). `add_generation_prompt`
        appends the assistant header (default True here; transformers defaults to False).
        Extra keyword arguments become template variables and override special tokens.
        Raises ChatTemplateError for an empty or malformed conversation or a template that
        raises on it. Does not tokenize: encode the text with add_special_tokens=False."""
        if isinstance(messages, str | bytes) or not messages:
            raise ChatTemplateError("messages must be a non-empty list of message objects")
        if not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("every message must be an object with 'role' and 'content'")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        template = self._named.get("tool_use", self._template) if tools else self._template
        variables = _plain({**self.special_tokens, **kwargs})
        import jinja2

        try:
            return str(
                template.render(
                    messages=_plain(chat),
                    tools=_plain(tools),
                    documents=_plain(documents),
                    add_generation_prompt=add_generation_prompt,
                    **variables,
                )
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc
