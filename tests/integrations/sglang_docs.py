"""The doc-test blocks of docs/sglang.md, read by the tests that run them."""

from __future__ import annotations

from pathlib import Path

try:  # the docs site's one reader of doc-test blocks, where it exists
    from tests.docs.blocks import block as doc_block
except ImportError:  # pragma: no cover - until tests/docs/blocks.py is on this branch
    ROOT = Path(__file__).resolve().parents[2]

    def doc_block(page: str, id: str) -> str:
        """The text between the fence after ``<!-- doc-test: id -->`` and its closing fence."""
        lines = (ROOT / "docs" / page).read_text(encoding="utf-8").splitlines()
        marker = f"<!-- doc-test: {id} -->"
        found = [i for i, line in enumerate(lines) if line.strip() == marker]
        if len(found) != 1:
            raise LookupError(f"{page}: {len(found)} blocks marked doc-test: {id} (expected 1)")
        start = found[0] + 1
        fence = lines[start].strip()[:3]
        end = next(j for j in range(start + 1, len(lines)) if lines[j].strip() == fence)
        return "\n".join(lines[start + 1 : end]) + "\n"


__all__ = ["doc_block"]
