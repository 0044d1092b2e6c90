"""Function calling for the chat API: OpenAI's ``tools`` and ``tool_choice``.

Calls use the Hermes convention that Qwen2.5, Hermes and many other templates are trained on:
the model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A template
that renders ``tools`` itself (it mentions the variable) gets them as they are; for one that
does not (SmolLM2's, the default model's), the tool list and the calling convention are
written into the system message, assistant calls in the history into that text form, and
``tool`` messages into ``<tool_response>`` user turns, so any chat model can be asked.

``tool_choice``: "none" sends no tools and parses nothing; "auto" (the default with tools)
parses calls out of the text; "required" and a named function constrain the output with a
JSON-schema grammar to exactly one call of an allowed function, so the call always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvflow.stages.api.http_errors import HttpError
from kvflow.stages.engine import GrammarSpec

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>{tools}</tools> For each function call return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask for. ``mode``: "none", "auto", "required" or "named"
    (``name`` then says which)."""

    functions: tuple[dict[str, Any], ...]
    mode: str
    name: str | None = None

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolPlan | None:
        """The plan of a request's fields; None without tools. HttpError(400) names what is
        wrong."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise HttpError(400, "tool_choice needs tools", param="tool_choice")
            return None
        functions = tuple(_function(i, t) for i, t in enumerate(tools))
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise HttpError(400, "tools: function names must be unique", param="tools")
        if tool_choice in (None, "auto"):
            return cls(functions, "auto")
        if tool_choice in ("none", "required"):
            return cls(functions, tool_choice)
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
            name = (tool_choice.get("function") or {}).get("name")
            if name not in names:
                msg = f"tool_choice names no given function: {name!r}"
                raise HttpError(400, msg, param="tool_choice")
            return cls(functions, "named", name)
        raise HttpError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}',
            param="tool_choice",
        )

    @property
    def active(self) -> bool:
        """Whether tools go into the prompt and calls are parsed (not for "none")."""
        return self.mode != "none"

    def grammar(self) -> GrammarSpec | None:
        """For "required"/"named": the JSON schema of one call of an allowed function."""
        if self.mode not in ("required", "named"):
            return None
        allowed = [f for f in self.functions if self.mode == "required" or f["name"] == self.name]
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in allowed
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return GrammarSpec("json_schema", json.dumps(schema))

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as OpenAI's request gave them, for templates that render tools."""
        return [{"type": "function", "function": f} for f in self.functions]

    def system_text(self) -> str:
        """The Hermes tool instructions, for templates that do not render tools."""
        return HERMES_SYSTEM.format(tools=json.dumps(self.template_tools()))

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished output. A constrained output ("required",
        "named") is one call as JSON; an "auto" output has calls in <tool_call> tags (text
        around them is the content). Text that is not a well-formed call of a given function
        stays content."""
        if self.mode in ("required", "named"):
            call = _call_of(text.strip(), self.functions)
            return (None, [call]) if call else (text, [])
        calls, kept, last = [], [], 0
        for m in _CALL.finditer(text):
            call = _call_of(m.group(1), self.functions)
            if call is None:
                continue
            kept.append(text[last : m.start()])
            last = m.end()
            calls.append(call)
        if not calls:
            return text, []
        kept.append(text[last:])
        content = "".join(kept).strip()
        return (content or None), calls


def _function(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise HttpError(400, f'{where}: only {{"type": "function", ...}} tools', param="tools")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise HttpError(400, f"{where}.function needs a name", param="tools")
    if not _NAME.match(fn["name"]):
        raise HttpError(400, f"{where}.function.name must match {_NAME.pattern}", param="tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise HttpError(400, f"{where}.function.parameters must be a JSON schema", param="tools")
    return {k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")}


def _call_of(text: str, functions: tuple[dict[str, Any], ...]) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in {f["name"] for f in functions}:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args)},
    }


def messages_for_plain_template(
    messages: list[dict[str, Any]], plan: ToolPlan | None
) -> list[dict[str, Any]]:
    """``messages`` for a template that does not render tools: the tool instructions in the
    system message, assistant calls as <tool_call> text, tool results as <tool_response>
    user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if role == "assistant" and m.get("tool_calls"):
            calls = [
                "<tool_call>\n"
                + json.dumps(
                    {
                        "name": c.get("function", {}).get("name"),
                        "arguments": _loads(c.get("function", {}).get("arguments")),
                    }
                )
                + "\n</tool_call>"
                for c in m["tool_calls"]
            ]
            text = "\n".join(([content] if content else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{content or ''}\n</tool_response>"}
            )
        else:
            out.append(m)
    if plan is not None and plan.active:
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{plan.system_text()}"}
        else:
            out.insert(0, {"role": "system", "content": plan.system_text()})
    return out


def _loads(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args
