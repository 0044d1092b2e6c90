"""A real multi-process cluster on 127.0.0.1: 3 metadata replicas, 2 prefill nodes, 2 decode
nodes and 2 routers (`kvflow.tools.supervise.LocalCluster`, the code behind `kvflow cluster`).
Requests go through InferenceClient with both routers listed, as a user's client would.

The tests share one cluster; the failure tests come last. Each kills what it needs, and
``heal`` starts again whatever an earlier test killed before the next one runs, so no test
depends on another's leftovers and a failure does not cascade.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvflow.kvdb import KVLayout, Namespace, block_keys
from kvflow.replication import NodeId, RemoteMetadata
from kvflow.security.grpc_auth import cluster_channel
from kvflow.stages.api import node_pb2, node_pb2_grpc, pb2, pb2_grpc
from kvflow.stages.api.client import InferenceClient
from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.tools.cli import main
from kvflow.tools.supervise import LocalCluster
from tests.cluster_member import heal, running_as_member

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BLOCK = 16


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        tmp_path_factory.mktemp("cluster"),
        meta=3,
        prefill=2,
        decode=2,
        model=tiny_model,
        extra=("--block-size", str(BLOCK), "--num-pages", "256", "--dram-mb", "64"),
        router_extra=("--policy", "round-robin"),
        routers=2,
    )
    with running_as_member(c, timeout_s=180):  # stops every process (paused ones too)
        yield c


@pytest.fixture(autouse=True)
def whole(cluster: LocalCluster) -> None:
    heal(cluster)


def generate(
    cluster: LocalCluster, ids: list[int], max_tokens: int = 8
) -> tuple[list[int], object]:
    with InferenceClient(cluster.addresses) as client:
        req = pb2.GenerateRequest(max_tokens=max_tokens)
        req.token_ids.ids.extend(ids)
        msgs = list(client.generate(req, timeout=120))
    return [t for m in msgs for t in m.token_ids], msgs[-1].usage


def long_request(ids: list[int], max_tokens: int = 400) -> pb2.GenerateRequest:
    req = pb2.GenerateRequest(max_tokens=max_tokens, sampling=pb2.SamplingParams(ignore_eos=True))
    req.token_ids.ids.extend(ids)
    return req


def reference(model: Path, ids: list[int], max_tokens: int) -> list[int]:
    engine = Engine.open(model, EngineConfig(block_size=BLOCK, num_pages=64))
    return engine.generate([ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]


def wait_for_blocks(cluster: LocalCluster, node: str, n: int, timeout_s: float = 60.0) -> None:
    """Until every live metadata replica reports ``n`` blocks on ``node`` (a node may read
    from any replica, and followers apply a commit a moment after the leader)."""
    deadline = time.monotonic() + timeout_s
    for name, address in zip(cluster.procs, cluster.meta_addresses, strict=False):
        if not cluster.procs[name].alive():
            continue
        with RemoteMetadata([address]) as meta:
            while meta.view().blocks_on(NodeId(node)) < n:
                assert time.monotonic() < deadline, f"{address}: {node} has < {n} blocks"
                time.sleep(0.05)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def blocks_held(cluster: LocalCluster, node: str) -> int:
    with RemoteMetadata(cluster.meta_addresses) as meta:
        return meta.view().blocks_on(NodeId(node))


def test_http_and_logprobs_through_a_router(cluster, tiny_model):
    """The router's HTTP front, and logprobs / penalties / stop strings over the node API."""
    import http.client

    ids = prompt(40, seed=11)
    engine = Engine.open(tiny_model, EngineConfig(block_size=BLOCK, num_pages=64))
    engine.add_request("r", ids, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    want_ids, want_lps = [], []
    while engine.has_unfinished():
        for out in engine.step():
            want_ids += out.new_token_ids
            want_lps += [lp.logprob for lp in out.logprobs]
    port = cluster.http_ports[0]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "ignore_eos": True, "logprobs": 2}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    doc = json.loads(conn.getresponse().read())
    lps = doc["choices"][0]["logprobs"]
    assert lps["token_logprobs"] == pytest.approx(want_lps, abs=1e-4)
    # keyed by token text (the legacy format): two byte tokens may share the text "\ufffd"
    assert all(1 <= len(top) <= 2 for top in lps["top_logprobs"])
    # prompt logprobs over gRPC, from position 20 (the router's first prefill is cold anyway)
    with InferenceClient(cluster.addresses) as client:
        req = pb2.GenerateRequest(max_tokens=3, logprob_start=20)
        req.sampling.prompt_logprobs = 1
        req.sampling.repetition_penalty = 1.3
        req.token_ids.ids.extend(ids)
        msgs = list(client.generate(req, timeout=120))
    last = msgs[-1]
    assert last.prompt_logprobs_start <= 20
    assert [p.token_id for p in last.prompt_logprobs][-20:] == ids[20:]
    conn.close()


def test_a_grammar_travels_to_the_nodes(cluster):
    """Structured output in a cluster: the router checks the grammar (a bad one is a 400 /
    INVALID_ARGUMENT before routing), the prefill node samples the first token under it and
    the decode node continues it; the tiny model's random weights never write this alone."""
    import http.client

    phone = r"[0-9]{3}-[0-9]{4}"
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_ports[0], timeout=120)
    for seed in range(3):
        body = {
            "text": "Call me at ",
            "sampling_params": {
                "max_new_tokens": 24,
                "temperature": 1.0,
                "sampling_seed": seed,
                "regex": phone,
            },
        }
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        doc = json.loads(resp.read())
        assert resp.status == 200, doc
        assert re.fullmatch(phone, doc["text"]), doc["text"]
    bad = {
        "model": "tiny",
        "prompt": "x",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "nope"}},
        },
    }
    conn.request("POST", "/v1/completions", json.dumps(bad), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and b"json_schema" in resp.read()
    conn.close()
    with InferenceClient(cluster.addresses) as client:
        req = pb2.GenerateRequest(prompt="Call me at ", max_tokens=24)
        req.sampling.grammar_kind, req.sampling.grammar = "regex", phone
        req.sampling.temperature = 1.0
        text = "".join(m.text for m in client.generate(req, timeout=120))
    assert re.fullmatch(phone, text), text


def test_a_prefix_computed_on_one_node_is_served_by_the_other_over_tcp(cluster, tiny_model):
    """Both ways (round-robin: p0, p1, then a filler on p0, then p1, p0): whichever node
    registered first must still find the other as a peer."""
    engine = Engine.open(tiny_model, EngineConfig(block_size=BLOCK, num_pages=64))
    pairs = []
    for seed in (1, 3):
        ids = prompt(100, seed=seed)
        held = {p: blocks_held(cluster, p) for p in ("prefill-0", "prefill-1")}
        out1, u1 = generate(cluster, ids)
        # Blocks reach the metadata asynchronously (a batched flush, then a Raft commit):
        # until they do, another node cannot know they exist and would recompute.
        wait_for_blocks(cluster, u1.prefill_instance, held[u1.prefill_instance] + 6)
        out2, u2 = generate(cluster, ids)  # round-robin: the other prefill node
        pairs.append((u1.prefill_instance, u2.prefill_instance))
        assert u1.cached_tokens == 0
        assert u2.cached_tokens == 96 and u2.pulled_tokens == 96, pairs
        assert {t.tier: t.tokens for t in u2.cached_by_tier} == {"remote": 96}
        assert out1 == out2 == engine.generate([ids], SamplingParams(max_tokens=8))[0]
        if seed == 1:
            generate(cluster, prompt(20, seed=2))  # a filler, so the next pair runs backwards
    assert sorted(pairs) == [("prefill-0", "prefill-1"), ("prefill-1", "prefill-0")]


def test_admin_cli_sees_every_node_and_both_replicas(cluster, capsys):
    node = f"127.0.0.1:{cluster.node_ports['prefill-0']}"
    capsys.readouterr()
    assert main(["kvdb", "--server", node, "nodes", "--json"]) == 0
    nodes = {n["node"]: n for n in json.loads(capsys.readouterr().out)}
    assert set(nodes) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert main(["kvdb", "--server", node, "hot", "-n", "1", "--json"]) == 0
    key = json.loads(capsys.readouterr().out)[0]["key"]
    assert main(["kvdb", "--server", node, "replicas", key, "--json"]) == 0
    replicas = json.loads(capsys.readouterr().out)
    assert {"prefill-0", "prefill-1"} <= set(json.dumps(replicas).replace('"', " ").split())


def test_a_replica_target_is_placed_on_another_node(cluster):
    ids = prompt(50, seed=20)
    _, usage = generate(cluster, ids)
    holder = usage.prefill_instance
    other = "prefill-1" if holder == "prefill-0" else "prefill-0"
    with RemoteMetadata(cluster.meta_addresses) as meta:
        view = meta.view()
        deadline = time.monotonic() + 60
        while True:  # until the new prompt's blocks are registered (asynchronously)
            here = set(view.keys_on(NodeId(holder))) - set(view.keys_on(NodeId(other)))
            if here:
                break
            assert time.monotonic() < deadline, f"{holder} never registered the new blocks"
            time.sleep(0.05)
        key = sorted(here)[0]
        meta.set_replica_target(key, 2)
        deadline = time.monotonic() + 60
        while view.replica_count(key) < 2:
            assert time.monotonic() < deadline, "the replica target was never met"
            time.sleep(0.1)
            view.forget([key])
        assert set(view.replicas(key)) == {holder, other}


def _node_stub(cluster: LocalCluster, name: str) -> tuple[grpc.Channel, Any]:
    channel = cluster_channel(f"127.0.0.1:{cluster.node_ports[name]}", cluster.secret)
    return channel, node_pb2_grpc.NodeStub(channel)


def _prefill_on(
    cluster: LocalCluster, node: str, ids: list[int], **pull: Any
) -> tuple[Any, list[bytes]]:
    """A Prefill call straight to ``node`` (as a router sends it) with the given pull fields;
    returns its done event and the prompt's block keys."""
    decode_channel, decode = _node_stub(cluster, "decode-0")
    channel, stub = _node_stub(cluster, node)
    with decode_channel, channel:
        info = stub.Info(node_pb2.InfoRequest(), timeout=10)
        rid = f"pull-{node}-{random.Random(len(ids)).random()}"
        pages = -(-len(ids) // BLOCK)
        lease = decode.Reserve(node_pb2.ReserveRequest(request_id=rid, num_pages=pages), timeout=10)
        req = node_pb2.PrefillRequest(
            request_id=rid,
            token_ids=ids,
            sampling=node_pb2.Sampling(),
            target_transfer_address=lease.transfer_address,
            target_segment=lease.segment,
            target_offsets=lease.offsets,
            **pull,
        )
        try:
            events = list(stub.Prefill(req, timeout=60))
        finally:
            decode.Release(node_pb2.ReleaseRequest(lease_id=lease.lease_id), timeout=10)
    layout = KVLayout(
        info.num_layers, info.num_kv_heads, info.head_dim, info.block_size, info.dtype
    )
    keys = block_keys(Namespace("default", info.model_fingerprint, layout), ids)
    return events[-1], keys


def test_a_planned_pull_travels_to_the_prefill_node_which_pulls_exactly_that(cluster):
    """Algorithm 1 in the cluster: the conductor's plan (holder, blocks) reaches the prefill
    node in the Prefill call; the node copies exactly those blocks from the holder (replica
    count 2 in the metadata) and nothing more from prefill nodes, although the holder has more.
    With the policy deciding pulls and no plan (below the balancing threshold), it pulls
    nothing."""
    ids = prompt(200, seed=40)  # 12 usable blocks
    _, usage = generate(cluster, ids)
    holder = usage.prefill_instance
    other = "prefill-1" if holder == "prefill-0" else "prefill-0"
    wait_for_blocks(cluster, holder, 12)
    done, keys = _prefill_on(
        cluster,
        other,
        ids,
        pull_from=holder,
        pull_start_block=0,
        pull_num_blocks=5,
        pulls_decided=True,
    )
    assert done.pulled_tokens == 5 * BLOCK and done.cached_tokens == 5 * BLOCK
    with RemoteMetadata(cluster.meta_addresses) as meta:
        deadline = time.monotonic() + 60
        while meta.view().replica_count(keys[4]) < 2:
            assert time.monotonic() < deadline, "the pulled blocks never reached the metadata"
            time.sleep(0.05)
            meta.view().forget(keys)
        assert set(meta.view().replicas(keys[0])) == {holder, other}

    ids2 = prompt(200, seed=41)
    _, usage2 = generate(cluster, ids2)
    wait_for_blocks(cluster, usage2.prefill_instance, 1)
    target = "prefill-1" if usage2.prefill_instance == "prefill-0" else "prefill-0"
    done2, _ = _prefill_on(cluster, target, ids2, pulls_decided=True)
    assert done2.pulled_tokens == 0 and done2.cached_tokens == 0


def test_one_trace_per_request_has_all_seven_stages_one_row_per_process(cluster, tmp_path):
    _, usage = generate(cluster, prompt(40, seed=50), max_tokens=4)
    out = tmp_path / "trace.json"
    assert main(["trace", "export", "--server", cluster.addresses[0], "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {
        e["pid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    mine = [
        e
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["args"]["_kvflow"]["request_id"] == usage.request_id
    ]
    stages = {e["name"] for e in mine if e["cat"] == "stage"}
    seven = {"tokenize", "hash", "route", "reuse-load", "prefill", "stream", "decode"}
    assert seven <= stages, stages
    where = {e["name"]: rows[e["pid"]] for e in mine if e["cat"] == "stage"}
    assert where["tokenize"] == where["route"] == "router"
    assert where["reuse-load"] == where["prefill"] == where["stream"] == usage.prefill_instance
    assert where["decode"] == usage.decode_instance
    # The node's spans start after the router sent the call (one wall clock).
    starts = {e["name"]: e["ts"] for e in mine if e["cat"] == "stage"}
    assert starts["route"] <= starts["reuse-load"] <= starts["decode"]


def test_every_process_serves_prometheus_metrics(cluster):
    import urllib.request

    wanted = {"meta": "kvflow_meta_is_leader", "prefill": "kvflow_store_hit_rate"}
    wanted |= {"decode": "kvflow_pipeline", "router": "kvflow_ttft_seconds"}
    for name, port in cluster.metrics_ports.items():
        if not cluster.procs[name].alive():
            continue
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert wanted[name.split("-")[0]] in text, name
        if name.startswith("prefill"):  # what the replicator could not copy (docs/durability.md)
            assert "# TYPE kvflow_replicator_failures_total counter" in text, name


def test_each_router_routes_on_the_load_the_other_sent(cluster):
    """Router-1 streams a long answer; router-0 learns from the decode node's own report that
    it is decoding (routers book only their own requests)."""
    seen: list[float] = []
    with InferenceClient([cluster.addresses[1]]) as client:
        stream = client.generate(long_request(prompt(40, seed=60), max_tokens=2000), timeout=120)
        next(stream)
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            stub = pb2_grpc.InferenceStub(channel)
            deadline = time.monotonic() + 60
            while not seen and time.monotonic() < deadline:
                stats = stub.Stats(pb2.StatsRequest(), timeout=5)
                seen = [
                    i.values["external_decode_batch_size"]
                    for i in stats.instances
                    if i.kind == "decode" and i.values["external_decode_batch_size"] >= 1
                ]
                time.sleep(0.1)
        rest = list(stream)
    assert seen == [1.0]
    assert sum(len(m.token_ids) for m in rest) == 1999


def test_flush_cache_on_a_router_empties_every_node_but_the_pinned_blocks(cluster):
    """POST /flush_cache on a router (400 before): Node.FlushCache on every node; the
    metadata follows, and a repeated prompt is computed again."""
    import http.client

    for seed in (70, 71):  # blocks on both prefill nodes (round-robin) and the decode nodes
        generate(cluster, prompt(64, seed=seed), max_tokens=20)
    nodes = ("prefill-0", "prefill-1", "decode-0", "decode-1")
    deadline = time.monotonic() + 60
    while sum(blocks_held(cluster, n) for n in nodes) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    held = {n: blocks_held(cluster, n) for n in nodes}
    assert sum(held.values()) >= 8, held
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_ports[0], timeout=60)
    conn.request("POST", "/flush_cache")
    reply = conn.getresponse()
    text = reply.read().decode()
    conn.close()
    assert reply.status == 200, text
    removed = int(text.split("Cache flushed: ")[1].split(" ")[0])
    assert removed >= sum(held.values()) > 0
    deadline = time.monotonic() + 60
    while any(blocks_held(cluster, n) for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {n: blocks_held(cluster, n) for n in nodes} == dict.fromkeys(nodes, 0)
    ids, usage = generate(cluster, prompt(64, seed=70), max_tokens=4)
    assert len(ids) == 4 and usage.cached_tokens == 0  # recomputed: nothing was left


def test_a_router_killed_mid_answer_is_resumed_by_the_client_on_the_other(cluster, tiny_model):
    ids = prompt(40, seed=40)
    with InferenceClient(cluster.addresses) as client:
        stream = client.generate(long_request(ids), timeout=120)
        first = next(stream)
        cluster.kill("router-0")  # the client's first choice
        rest = list(stream)
        assert client.failovers == 1
    tokens = [t for m in [first, *rest] for t in m.token_ids]
    assert tokens == reference(tiny_model, ids, 400)


def test_a_decode_node_killed_mid_stream_is_retried_with_the_same_output(cluster, tiny_model):
    ids = prompt(40, seed=30)
    with InferenceClient(cluster.addresses) as client:
        stream = client.generate(long_request(ids), timeout=120)
        first = next(stream)
        cluster.kill("decode-0")  # idle decode nodes tie on predicted TBT: decode-0 is chosen
        rest = list(stream)
    tokens = [t for m in [first, *rest] for t in m.token_ids]
    usage = rest[-1].usage
    assert usage.decode_instance == "decode-1"
    assert tokens == reference(tiny_model, ids, 400)


def router_counter(cluster: LocalCluster, name: str) -> float:
    """``name`` of the Stats' router counters, summed over the live routers."""
    total = 0.0
    for proc, address in zip(
        (p for n, p in cluster.procs.items() if n.startswith("router")), cluster.addresses,
        strict=True,
    ):
        if proc.alive():
            with grpc.insecure_channel(address) as channel:
                stats = pb2_grpc.InferenceStub(channel).Stats(pb2.StatsRequest(), timeout=10)
            total += stats.router[name]
    return total


def test_a_request_waits_while_the_last_decode_node_restarts(cluster, tiny_model):
    cluster.kill("decode-0")
    cluster.kill("decode-1")  # no decode node is left
    waits = router_counter(cluster, "instance_waits")
    ids = prompt(30, seed=50)
    result: dict[str, object] = {}

    def send() -> None:
        try:
            result["out"] = generate(cluster, ids, max_tokens=16)
        except Exception as exc:  # reported by the assertion below
            result["error"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 60  # the request is routed to a dead node, fails, waits
    while router_counter(cluster, "instance_waits") <= waits:
        assert sender.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.1)
    assert sender.is_alive(), result
    cluster.restart("decode-1")
    sender.join(180)
    assert not sender.is_alive(), "no answer 180 s after decode-1 restarted"
    assert "error" not in result, result.get("error")
    out, usage = result["out"]  # type: ignore[misc]
    assert usage.decode_instance == "decode-1"
    assert out == reference(tiny_model, ids, 16)[: len(out)] and len(out) >= 1


def test_a_killed_prefill_node_fails_no_request(cluster):
    cluster.kill("prefill-1")
    for seed in range(2, 6):
        ids = prompt(60, seed=seed)
        out, usage = generate(cluster, ids)
        assert len(out) == 8 and usage.prefill_instance == "prefill-0"


def test_a_killed_metadata_leader_fails_no_request(cluster):
    cluster.kill("prefill-1")  # every request on prefill-0: the repeat below is a local hit
    leader = cluster.metadata_leader()
    assert leader is not None
    cluster.kill(leader)  # writes go on after a re-election
    for seed in range(6, 9):
        out, usage = generate(cluster, prompt(60, seed=seed))
        assert len(out) == 8
    ids = prompt(60, seed=6)
    wait_for_blocks(cluster, "prefill-0", 3)
    _, usage = generate(cluster, ids)
    assert usage.cached_tokens == 48  # the store kept working: the repeat is a hit
    # Every request has ended: no node still books prefill or decode work.
    for name, port in cluster.node_ports.items():
        if cluster.procs[name].alive():
            with cluster_channel(f"127.0.0.1:{port}", cluster.secret) as channel:
                info = node_pb2_grpc.NodeStub(channel).Info(node_pb2.InfoRequest(), timeout=5)
            assert (info.queued_prefill_s, info.decode_batch_size) == (0.0, 0), name
