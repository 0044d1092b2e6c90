"""A paused process (SIGSTOP: connections open, nothing answers) costs a request about a second
more than a healthy cluster, not the whole pause: a prefill node (the router's NodeGuard
probes it, ends the call and routes again), the metadata leader (reads go to another
replica after one 0.5 s attempt; the replica's breaker keeps it last), a prefill node that
holds the blocks another prefill node reads (the read's deadline is sized to its bytes, the
reader's breaker for that peer opens, the rest is recomputed) and a decode node (the
router watches it while a Prefill streams into it; the prefill node's stream has a sized
deadline and a breaker per decode node; the request goes to the other decode node).

Before: the router's Prefill call to a paused node waited for its 600 s deadline, a
metadata read for its 6 s attempt timeout, a block read for its 5 s Lease deadline (5.07 s
measured), and a Prefill streaming into a paused decode node until its own deadline (about
8 s measured), after which the router blamed the prefill node. Real processes (LocalCluster), so
`slow`."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow.replication import NodeId, RemoteMetadata
from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient
from kvflow.tools.supervise import LocalCluster
from tests.cluster_member import heal, running_as_member

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# The added latency we accept: the target is about 1 s (probe interval + probe timeout);
# the rest is slack for a shared 2-core machine.
ADDED_S = 2.0
# A paused node against a dead one (whose calls fail at once): the probe's second, plus slack.
DEAD_SLACK_S = 1.5


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        tmp_path_factory.mktemp("hung"),
        meta=3,
        prefill=2,
        decode=2,
        model=tiny_model,
        # small prefill steps: a 512-token prompt streams its KV over 16 steps
        extra=(
            "--block-size",
            "16",
            "--num-pages",
            "512",
            "--dram-mb",
            "32",
            "--prefill-chunk",
            "32",
        ),
        router_extra=("--policy", "round-robin"),
    )
    with running_as_member(c, timeout_s=120):  # stops every process (paused ones too)
        yield c


@pytest.fixture(autouse=True)
def whole(cluster: LocalCluster) -> None:
    heal(cluster)


def _blocks_on(cluster: LocalCluster, node: str) -> list[int]:
    """How many blocks each live metadata replica records on ``node``."""
    counts = []
    for i, address in enumerate(cluster.meta_addresses):
        if cluster.procs[f"meta-{i}"].alive():
            with RemoteMetadata([address], cache_ttl_s=0) as meta:
                counts.append(meta.view().blocks_on(NodeId(node)))
    return counts


def _generate(
    cluster: LocalCluster, prompt: list[int], max_tokens: int = 4
) -> tuple[float, pb2.Usage]:
    """(seconds, usage) of one request; it must produce all its tokens."""
    req = pb2.GenerateRequest(max_tokens=max_tokens)
    req.token_ids.ids.extend(prompt)
    req.sampling.ignore_eos = True
    t0 = time.monotonic()
    with InferenceClient(cluster.addresses) as client:
        msgs = list(client.generate(req, timeout=60))
    assert sum(len(m.token_ids) for m in msgs) == max_tokens
    return time.monotonic() - t0, msgs[-1].usage


def _prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _timed(cluster: LocalCluster, seed: int, max_tokens: int = 4) -> float:
    return _generate(cluster, _prompt(seed), max_tokens)[0]


def _baseline(cluster: LocalCluster, max_tokens: int = 4) -> float:
    times = sorted(_timed(cluster, 1000 + i, max_tokens) for i in range(4))
    return times[len(times) // 2]


def _paused(cluster: LocalCluster, name: str, n: int, seed: int) -> list[float]:
    with cluster.paused(name):
        return [_timed(cluster, seed + i) for i in range(n)]


def test_a_paused_prefill_node_costs_about_a_second(cluster: LocalCluster) -> None:
    base = _baseline(cluster)
    # round-robin over two prefill nodes: of 3 requests at least one is sent to the paused one
    times = _paused(cluster, "prefill-0", 3, seed=2000)
    print(f"prefill-0 paused: baseline p50 {base:.2f}s, requests {[round(t, 2) for t in times]}")
    assert max(times) - base < ADDED_S, (base, times)
    cluster.wait_serving(30)


def test_a_paused_metadata_leader_costs_about_a_second(cluster: LocalCluster) -> None:
    base = _baseline(cluster)
    leader = cluster.metadata_leader()
    assert leader is not None
    times = _paused(cluster, leader, 3, seed=3000)
    print(f"{leader} (leader) paused: baseline p50 {base:.2f}s, {[round(t, 2) for t in times]}")
    assert max(times) - base < ADDED_S, (base, times)


def test_a_paused_block_holder_costs_about_a_second(cluster: LocalCluster) -> None:
    """The other prefill node reads the prefix's blocks from the paused one (round-robin is
    cache-blind: reuse-load continues the local prefix from any holder)."""
    base = _baseline(cluster)
    prefix = _prompt(4000, 64)  # 4 blocks of 16
    before = {n: min(_blocks_on(cluster, n)) for n in ("prefill-0", "prefill-1")}
    _, usage = _generate(cluster, [*prefix, 7])
    holder = usage.prefill_instance  # it computed and stored the prefix's blocks
    reader = next(n for n in cluster.procs if n.startswith("prefill") and n != holder)
    deadline = time.monotonic() + 60  # every replica records them (in batches, asynchronously)
    while min(_blocks_on(cluster, holder)) < before[holder] + 4:
        assert time.monotonic() < deadline, f"{holder}'s new blocks never reached the metadata"
        time.sleep(0.1)
    times = []
    with cluster.paused(holder):
        for i in range(4):
            t, usage = _generate(cluster, [*prefix, *_prompt(4100 + i, 8)])
            assert usage.prefill_instance == reader
            times.append(t)
    log = (cluster.data_dir / f"{reader}.log").read_text()
    assert f"reading from {holder} failed" in log  # the paused holder was asked
    print(f"{holder} (holder) paused: baseline p50 {base:.2f}s, {[round(t, 2) for t in times]}")
    assert max(times) - base < ADDED_S, (base, times)
    cluster.wait_serving(30)


def _load(cluster: LocalCluster, seed: int, during: Any) -> list[float]:
    """Ten requests (512-token prompts, 8 tokens out) started 0.05 s apart from threads;
    ``during()`` runs after the fourth has started. The prefill nodes queue them, so some
    have their decode staging reserved and are waiting for or running their prefill (their
    KV will stream into the decode node) while others decode: requests in flight at every
    hop, and new ones after."""
    times: list[float] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            times.append(_generate(cluster, _prompt(seed + i, 512), 8)[0])
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for i, t in enumerate(threads):
        t.start()
        if i == 3:
            during()
        time.sleep(0.05)
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert len(times) == len(threads)
    return times


def test_a_paused_decode_node_costs_about_a_second_more_than_a_dead_one(
    cluster: LocalCluster,
) -> None:
    """Requests in flight and new ones while decode-0 is paused, then the same load while
    decode-1 is dead (SIGKILL: calls fail at once), both against the same healthy run."""
    base = max(_load(cluster, 5000, lambda: None))
    decode0 = cluster.procs["decode-0"]
    try:
        paused = _load(cluster, 5100, decode0.pause)
    finally:
        decode0.resume()
    cluster.wait_serving(30)
    try:
        dead = _load(cluster, 5200, lambda: cluster.kill("decode-1"))
    finally:
        cluster.restart("decode-1")
    print(
        f"decode node paused: healthy max {base:.2f}s, paused {max(paused):.2f}s, "
        f"dead {max(dead):.2f}s"
    )
    assert max(paused) <= max(dead) + DEAD_SLACK_S, (paused, dead)
    assert max(paused) - base < ADDED_S, (base, paused)
    cluster.wait_serving(60)
