"""The fenced blocks of the docs, by the marker before each: ``<!-- doc-test: ID -->`` (a test
runs that exact block) or ``<!-- illustrative: REASON -->`` (an output sample, or a command no
test can run, and why).

``block(page, id)`` is the one way a test reads a doc-test block: ``page`` is a file under
docs/ (``"quickstart.md"``) or ``"README.md"`` (the repository's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKER = re.compile(r"^<!--\s*(doc-test|illustrative):\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (1-based line of the fence), its info string, its
    text, and the marker on the line before it (kind "doc-test" / "illustrative" / None)."""

    page: str
    line: int
    info: str
    text: str
    kind: str | None
    label: str  # the doc-test ID or the illustrative reason


def page_path(page: str) -> Path:
    return ROOT / "README.md" if page == "README.md" else DOCS / page


def pages() -> list[str]:
    """README.md and every Markdown page under docs/."""
    return ["README.md", *sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))]


def blocks(page: str) -> list[Block]:
    """Every fenced block of ``page``, in order (a fence inside another block is text)."""
    lines = page_path(page).read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, info = opening.groups()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            closing = FENCE.match(lines[i])
            if closing and closing.group(2).startswith(fence) and not closing.group(3).strip():
                break
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        marker = MARKER.match(lines[start - 1]) if start > 0 else None
        out.append(
            Block(
                page=page,
                line=start + 1,
                info=info.strip(),
                text="\n".join(body) + "\n",
                kind=marker.group(1) if marker else None,
                label=marker.group(2) if marker else "",
            )
        )
        i += 1
    return out


def block(page: str, id: str) -> str:
    """The text of the block marked ``<!-- doc-test: id -->`` in ``page``."""
    found = [b for b in blocks(page) if b.kind == "doc-test" and b.label == id]
    if len(found) != 1:
        raise LookupError(f"{page}: {len(found)} blocks marked doc-test: {id} (expected 1)")
    return found[0].text
