"""docs/warmup.md's dry run, run as written against a real embedded server with warm-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.docs.blocks import block
from tests.docs.shell import run_bash


def test_warmup_dry_run_block(tiny_model: Path, make_warm: Any, tmp_path: Path) -> None:
    w = make_warm(tiny_model)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"prompt": "' + "kv cache " * 20 + '"}\n')
    (corpus / "b.txt").write_text("a document about blocks " * 5)
    out = run_bash(block("warmup.md", "warmup-dry-run"), tmp_path, grpc=w.server.address)
    assert out.stdout.startswith("dry run: 2/2 items,"), out.stdout
