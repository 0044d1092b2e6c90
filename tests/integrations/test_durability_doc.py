"""docs/durability.md's doc-test blocks, run as written."""

from __future__ import annotations

from kvflow.integrations.mooncake import NO_AVAILABLE_HANDLE, MooncakeDistributedStore
from tests.docs.blocks import block
from tests.integrations.test_sglang_cluster import meta  # noqa: F401 - fixture

PAGE = "durability.md"


def test_replica_num_snippet_acknowledges_with_two_members_and_refuses_with_one(
    meta: str,  # noqa: F811
) -> None:
    code = block(PAGE, "mooncake-replica-num")
    peer = MooncakeDistributedStore()
    assert peer.setup("127.0.0.1", meta, 8 << 20) == 0
    try:
        scope: dict[str, object] = {"META": meta}
        exec(compile(code, PAGE, "exec"), scope)
        assert scope["code"] == 0 and scope["value"] == b"hello, durable world"
        assert peer.get("greeting") == b"hello, durable world"  # the pushed copy
    finally:
        peer.close()
    alone: dict[str, object] = {"META": meta}  # the peer left: one member cannot hold two
    exec(compile(code.replace('"greeting"', '"greeting-2"'), PAGE, "exec"), alone)
    assert alone["code"] == NO_AVAILABLE_HANDLE and alone["value"] == b""
