"""Warm-up jobs through a real LocalCluster (1 metadata replica, 2 prefill nodes, 1 decode
node, 2 routers; the small demo model), submitted to a router as `kvflow warmup` does.

On one cluster: a job over a corpus (every item then hits all its full blocks with the cold
greedy output; replicas reach their target; blocks are pinned on the nodes), a router killed
the moment it accepted a job (the job was in the metadata group before the answer: the other
router shows it at once and finishes it), a router killed mid-job (the other router takes the
job over and finishes it without redoing finished items), a prefill node killed mid-job (its
items are redone on the other node). Each test starts on the whole cluster (``heal``: what an
earlier test killed is started again), so a failure does not cascade.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvflow.kvdb.proto import pb2 as admin_pb2
from kvflow.kvdb.proto import pb2_grpc as admin_pb2_grpc
from kvflow.security.grpc_auth import cluster_channel
from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient
from kvflow.stages.api.warmup import warmup_pb2, warmup_pb2_grpc
from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.stages.warmup.materialize import trace_block_tokens
from kvflow.tools.cli import main
from kvflow.tools.supervise import LocalCluster
from tests.cluster_member import heal, running_as_member

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BLOCK = 16


@pytest.fixture(scope="module")
def cluster(small_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        tmp_path_factory.mktemp("warm-cluster"),
        meta=1,
        prefill=2,
        decode=1,
        model=small_model,
        extra=("--block-size", str(BLOCK), "--num-pages", "256", "--dram-mb", "96"),
        routers=2,
    )
    with running_as_member(c, timeout_s=180):  # stops every process (paused ones too)
        yield c


@pytest.fixture(autouse=True)
def whole(cluster: LocalCluster) -> None:
    heal(cluster)


def until(what: str, done: Any, timeout_s: float = 120.0) -> Any:
    """Poll ``done()`` until it returns something true; fail naming ``what`` after the
    deadline (generous: a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout_s
    while not (value := done()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return value


def stub(address: str) -> Any:
    return warmup_pb2_grpc.WarmupStub(grpc.insecure_channel(address))


def trace(first: int, n: int, blocks: int) -> list[dict[str, Any]]:
    return [{"hash_ids": [first + 100 * i + j for j in range(blocks)]} for i in range(n)]


def submit(address: str, lines: list[dict[str, Any]], **options: Any) -> str:
    body = "\n".join(json.dumps(x) for x in lines).encode()
    req = warmup_pb2.SubmitRequest(
        files=[warmup_pb2.CorpusFile(name="c.jsonl", content=body)],
        options=warmup_pb2.JobOptions(**options),
    )
    return str(stub(address).Submit(req, timeout=60).job.job_id)


def status(address: str, job: str) -> Any:
    return stub(address).Status(warmup_pb2.JobRequest(job_id=job), timeout=10)


def wait(address: str, job: str, timeout_s: float = 240.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while (s := status(address, job)).state not in ("done", "cancelled", "failed"):
        assert time.monotonic() < deadline, f"job {job}: {s}"
        time.sleep(0.1)
    return s


def report(address: str, job: str) -> Any:
    return stub(address).Report(warmup_pb2.JobRequest(job_id=job), timeout=60)


def tokens(line: dict[str, Any], vocab: int) -> list[int]:
    return [t for h in line["hash_ids"] for t in trace_block_tokens(h, BLOCK, vocab)]


def generate(cluster: LocalCluster, ids: list[int], max_tokens: int) -> tuple[list[int], Any]:
    with InferenceClient(cluster.addresses) as client:
        req = pb2.GenerateRequest(
            max_tokens=max_tokens, sampling=pb2.SamplingParams(ignore_eos=True)
        )
        req.token_ids.ids.extend(ids)
        msgs = list(client.generate(req, timeout=120))
    return [t for m in msgs for t in m.token_ids], msgs[-1].usage


def pinned(cluster: LocalCluster, node: str) -> int:
    with cluster_channel(f"127.0.0.1:{cluster.node_ports[node]}", cluster.secret) as ch:
        reply = admin_pb2_grpc.KVAdminStub(ch).Shards(admin_pb2.ShardsRequest(), timeout=10)
    return sum(s.pinned_blocks for s in reply.shards)


def test_a_job_through_the_router_warms_every_item_with_cold_output(
    cluster: LocalCluster, small_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = Engine.open(small_model, EngineConfig(block_size=BLOCK, num_pages=64))
    vocab = engine.spec.vocab_size
    lines = trace(1, 4, 4)
    prompts = [tokens(x, vocab) for x in lines]
    cold = engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(x) for x in lines))
    argv = ["warmup", "--server", cluster.address, "--json", "submit", str(corpus)]
    assert main([*argv, "--replicas", "2", "--pin-ttl", "60"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["state"] == "done" and done["items_by_state"] == {"warmed": 4}
    job = done["job_id"]
    # the other router shows the job too (its record is in the metadata group; it re-reads
    # the records every second)
    assert wait(cluster.addresses[1], job, timeout_s=30).state == "done"
    deadline = time.monotonic() + 120
    while (rep := report(cluster.address, job)).totals.items_covered < 4 or any(
        r.min_replicas < 2 for r in rep.items
    ):
        assert time.monotonic() < deadline, rep
        time.sleep(0.3)
    assert rep.totals.blocks_cached == 16
    assert all(set(r.holders) == {"prefill-0", "prefill-1"} for r in rep.items)
    assert pinned(cluster, "prefill-0") + pinned(cluster, "prefill-1") >= 16
    for prompt, want in zip(prompts, cold, strict=True):
        out, usage = generate(cluster, prompt, 4)
        assert usage.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
        assert out == want


def _item_events(cluster: LocalCluster, job: str) -> list[int]:
    from kvflow.replication import RemoteMetadata

    with RemoteMetadata(cluster.meta_addresses) as meta:
        (record,), _ = meta.job_read(job)
    return [json.loads(e)["result"]["index"] for e in record.events if b'"kind": "item"' in e]


def test_a_router_killed_mid_job_the_other_router_finishes_it(cluster: LocalCluster) -> None:
    a, b = cluster.addresses
    job = submit(a, trace(10_000, 24, 2), segment_blocks=1)
    until("3 item results in the metadata", lambda: len(_item_events(cluster, job)) >= 3)
    cluster.kill("router-0")
    before = set(_item_events(cluster, job))
    assert 3 <= len(before) < 24
    final = wait(b, job)  # router-1 claims it once router-0's lease lapses
    assert final.state == "done" and final.items_finished == 24 and final.runs == 2
    indexes = _item_events(cluster, job)
    assert sorted(indexes) == list(range(24))  # each item once: none redone
    assert report(b, job).totals.items_covered == 24


def test_a_router_killed_when_it_accepted_a_job_the_other_router_finishes_it(
    cluster: LocalCluster,
) -> None:
    a, b = cluster.addresses
    job = submit(a, trace(30_000, 8, 2), segment_blocks=1)
    cluster.kill("router-0")  # SIGKILL at once: router-1 has not re-read the jobs yet
    seen = status(b, job)  # the record was committed before router-0 answered
    assert seen.job_id == job and seen.items_total == 8, seen
    final = wait(b, job)  # router-1 claims it once router-0's lease lapses
    assert final.state == "done" and final.items_finished == 8, final
    assert sorted(set(_item_events(cluster, job))) == list(range(8))
    assert report(b, job).totals.items_covered == 8


def test_a_prefill_node_killed_mid_job_its_items_are_redone_elsewhere(
    cluster: LocalCluster,
) -> None:
    a = cluster.address
    job = submit(a, trace(20_000, 16, 4), segment_blocks=1)
    until("4 items finished", lambda: status(a, job).items_finished >= 4)
    cluster.kill("prefill-1")
    final = wait(a, job)
    assert final.state == "done" and final.items_finished == 16, final
    rep = report(a, job)
    assert rep.totals.items_covered == 16, [(r.index, list(r.holders)) for r in rep.items]
    assert all("prefill-0" in r.holders for r in rep.items)
