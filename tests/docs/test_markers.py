"""Docs that cannot rot: every fenced block in README.md and docs/*.md is run by a test
(``<!-- doc-test: ID -->``, the ID used by a test under tests/) or says why not
(``<!-- illustrative: REASON -->``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, Block, block, blocks, pages

TESTS = ROOT / "tests"


def _all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


def _test_sources() -> str:
    return "\n".join(
        p.read_text(encoding="utf-8") for p in TESTS.rglob("*.py") if p.name != "test_markers.py"
    )


def test_every_fenced_block_is_marked() -> None:
    unmarked = [f"{b.page}:{b.line}" for b in _all_blocks() if b.kind is None]
    assert not unmarked, (
        "fenced blocks without <!-- doc-test: ID --> or <!-- illustrative: REASON --> on the "
        f"line before: {unmarked}"
    )


def test_illustrative_blocks_give_a_reason() -> None:
    bare = [f"{b.page}:{b.line}" for b in _all_blocks() if b.kind == "illustrative" and not b.label]
    assert not bare, f"illustrative blocks without a reason: {bare}"


def test_doc_test_ids_are_unique_and_used_by_a_test() -> None:
    ids = [(b.page, b.label) for b in _all_blocks() if b.kind == "doc-test"]
    twice = [i for i, n in Counter(label for _, label in ids).items() if n > 1]
    assert not twice, f"doc-test IDs used by more than one block: {twice}"
    sources = _test_sources()
    unused = [f"{page}: {label}" for page, label in ids if f'"{label}"' not in sources]
    assert not unused, f"doc-test blocks that no test under tests/ runs: {unused}"


def test_block_reads_the_block_after_its_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.docs import blocks as mod

    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text(
        "text\n\n<!-- doc-test: one -->\n```bash\necho 1\n  echo 2\n```\n\n"
        "<!-- illustrative: output -->\n````\n```\ninner\n```\n````\n\n```\nbare\n```\n"
    )
    monkeypatch.setattr(mod, "DOCS", tmp_path / "docs")
    assert block("p.md", "one") == "echo 1\n  echo 2\n"
    found = mod.blocks("p.md")
    assert [(b.kind, b.label) for b in found] == [
        ("doc-test", "one"),
        ("illustrative", "output"),
        (None, ""),
    ]
    assert found[1].text == "```\ninner\n```\n"
    with pytest.raises(LookupError, match="0 blocks marked doc-test: two"):
        block("p.md", "two")


def test_readme_stays_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail into docs/"
