"""docs/mooncake-store.md's doc-test blocks (read here between the marker and the closing
fence; tests/docs/blocks.py takes over when it lands)."""

from __future__ import annotations

from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "mooncake-store.md"


def block(block_id: str) -> str:
    lines = PAGE.read_text().splitlines()
    start = lines.index(f"<!-- doc-test: {block_id} -->") + 2  # past the marker and the fence
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[start:end]) + "\n"


def test_switch_block_runs() -> None:
    exec(compile(block("mooncake-switch"), str(PAGE), "exec"), {})
