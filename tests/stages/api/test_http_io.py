"""The SSE helpers alone (no server): a templated event is byte for byte the full encoding."""

from __future__ import annotations

import pytest

from kvflow.stages.api.http_io import SseTemplate, sse

TEXTS = ["", "plain", 'quo"te \\ back', "new\nline\t", "café 🙂 中文", "\u2028\x00", "\ufffd"]


@pytest.mark.parametrize("text", TEXTS)
def test_template_equals_full_encoding(text: str) -> None:
    def obj(value: str) -> dict[str, object]:
        return {"id": "cmpl-1", "model": "m", "choices": [{"text": value, "finish_reason": None}]}

    assert SseTemplate(obj(SseTemplate.SLOT))(text) == sse(obj(text))


def test_template_needs_exactly_one_slot() -> None:
    with pytest.raises(ValueError):
        SseTemplate({"a": "no slot"})
    with pytest.raises(ValueError):
        SseTemplate({"a": SseTemplate.SLOT, "b": SseTemplate.SLOT})
