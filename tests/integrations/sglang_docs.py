"""The doc-test blocks of docs/sglang.md, read by the tests that run them."""

from __future__ import annotations

from tests.docs.blocks import block as doc_block

__all__ = ["doc_block"]
