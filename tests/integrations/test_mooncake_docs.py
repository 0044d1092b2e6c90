"""docs/mooncake-store.md's doc-test blocks, run as written."""

from __future__ import annotations

from tests.docs.blocks import block


def test_switch_block_runs() -> None:
    exec(compile(block("mooncake-store.md", "mooncake-switch"), "mooncake-store.md", "exec"), {})
