"""A cluster whose decode node runs another dtype (int8) than its prefill node (bfloat16): the
router names the mismatch and never routes to that node, so no request decodes bf16 KV with
int8 weights. An int8 node's pages have a bf16 node's layout (bf16 KV), so without the check
the request would be served; only the model fingerprint, which includes the dtype, tells the
nodes apart."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient
from tests.faults.roles import HandStartedRoles

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

SMALL = ["--block-size", "16", "--num-pages", "64", "--dram-mb", "32", "--ssd-mb", "64"]


def test_router_refuses_a_node_of_another_dtype(tmp_path: Path, tiny_model: Path) -> None:
    cluster = HandStartedRoles(tmp_path, tiny_model, SMALL)
    nodes = {r.name: r for r in cluster.roles}
    nodes["prefill"].argv += ["--dtype", "bfloat16"]
    nodes["decode"].argv += ["--dtype", "int8"]
    ready = {"meta": "kvflow meta", "prefill": "kvflow node", "decode": "kvflow node"}
    try:
        for role in cluster.roles:
            role.start()
            role.wait_for(ready.get(role.name, "kvflow router on"), timeout_s=240)
        router = cluster.roles[-1]
        router.wait_for("node=decode-0 serves model", timeout_s=60)
        assert "(another model or --dtype); not routing to it" in router.output()
        req = pb2.GenerateRequest(max_tokens=2)
        req.token_ids.ids.extend(range(7, 30))
        client = InferenceClient([f"127.0.0.1:{cluster.router_port}"])
        with client, pytest.raises((grpc.RpcError, TimeoutError)):  # no decode node of its model
            list(client.generate(req, timeout=8))
    finally:
        for role in reversed(cluster.roles):
            role.stop()
