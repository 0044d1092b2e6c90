"""docs/durability.md's doc-test blocks, run as written (read between the marker and the
closing fence: tests/docs/blocks.py does not exist on this branch yet)."""

from __future__ import annotations

from pathlib import Path

from kvflow.integrations.mooncake import NO_AVAILABLE_HANDLE, MooncakeDistributedStore
from tests.integrations.test_sglang_cluster import meta  # noqa: F401 - fixture

PAGE = Path(__file__).resolve().parents[2] / "docs" / "durability.md"


def doc_block(page: Path, block_id: str) -> str:
    """The fenced block right after ``<!-- doc-test: block_id -->`` in ``page``."""
    lines = page.read_text().splitlines()
    start = lines.index(f"<!-- doc-test: {block_id} -->")
    assert lines[start + 1].startswith("```"), lines[start + 1]
    end = lines.index("```", start + 2)
    return "\n".join(lines[start + 2 : end]) + "\n"


def test_replica_num_snippet_acknowledges_with_two_members_and_refuses_with_one(
    meta: str,  # noqa: F811
) -> None:
    code = doc_block(PAGE, "mooncake-replica-num")
    peer = MooncakeDistributedStore()
    assert peer.setup("127.0.0.1", meta, 8 << 20) == 0
    try:
        scope: dict[str, object] = {"META": meta}
        exec(compile(code, str(PAGE), "exec"), scope)
        assert scope["code"] == 0 and scope["value"] == b"hello, durable world"
        assert peer.get("greeting") == b"hello, durable world"  # the pushed copy
    finally:
        peer.close()
    alone: dict[str, object] = {"META": meta}  # the peer left: one member cannot hold two
    exec(compile(code.replace('"greeting"', '"greeting-2"'), str(PAGE), "exec"), alone)
    assert alone["code"] == NO_AVAILABLE_HANDLE and alone["value"] == b""
