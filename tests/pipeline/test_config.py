"""PipelineConfig validation."""

from __future__ import annotations

import pytest

from kvflow.pipeline import PipelineConfig


def test_defaults_and_concurrency_precedence() -> None:
    config = PipelineConfig(default_concurrency=4, stage_concurrency={"prefill": 2})
    assert config.concurrency_for("prefill", 8) == 2
    assert config.concurrency_for("decode", 8) == 8
    assert config.concurrency_for("decode", None) == 4
    with pytest.raises(TypeError):
        config.stage_concurrency["decode"] = 1  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"queue_size": 0}, "queue_size"),
        ({"queue_size": True}, "queue_size"),
        ({"default_concurrency": 1.5}, "default_concurrency"),
        ({"trace_capacity": -1}, "trace_capacity"),
        ({"stage_concurrency": {"a": 0}}, "stage_concurrency\\['a'\\]"),
        ({"stage_concurrency": {"": 1}}, "stage_concurrency"),
        ({"stage_concurrency": [("a", 1)]}, "stage_concurrency"),
        ({"default_deadline_s": 0}, "default_deadline_s"),
        ({"default_deadline_s": float("inf")}, "default_deadline_s"),
        ({"cleanup_timeout_s": -1.0}, "cleanup_timeout_s"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PipelineConfig(**kwargs)  # type: ignore[arg-type]
