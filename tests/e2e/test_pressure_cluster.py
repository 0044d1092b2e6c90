"""A small real cluster under a burst (1 metadata replica, 2 prefill nodes, 2 decode nodes, 6
KV pages and 6 staging pages per node, 1 router, processes on 127.0.0.1): every request is
served, over the router's HTTP front (the openai client) and gRPC alike, with no 5xx and no
INTERNAL: a node that refuses for lack of room is backpressure; the router tries another one
or waits. A burst twelve times what the decode nodes hold at once, with outputs long enough
to outgrow a decode node's KV pages after the first token, streams exactly the tokens and
text each request gives alone: no error, nothing sent twice."""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient
from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.tools.supervise import LocalCluster
from tests.cluster_member import running_as_member

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PROMPT = [(11 * i + 5) % 200 + 1 for i in range(40)]  # 3 pages of 16: 2 fit a decode node


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        tmp_path_factory.mktemp("pressure"),
        meta=1,
        prefill=2,
        decode=2,
        model=tiny_model,
        extra=("--block-size", "16", "--num-pages", "6", "--dram-mb", "32"),
        router_extra=("--policy", "round-robin"),
    )  # fmt: skip
    with running_as_member(c, timeout_s=180):
        yield c


def router_metric(cluster: LocalCluster, name: str) -> float:
    port = cluster.metrics_ports["router-0"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.decode().splitlines()
        if line.startswith((name + " ", name + "{"))
    )


def test_burst_on_tiny_staging_gets_no_5xx(cluster: LocalCluster) -> None:
    client = openai.OpenAI(
        base_url=cluster.http_urls[0] + "/v1", api_key="unused", max_retries=0, timeout=180
    )

    def over_http(i: int) -> int:
        out = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True}
        )
        return out.usage.completion_tokens

    def over_grpc(i: int) -> int:
        req = pb2.GenerateRequest(max_tokens=4, request_id=f"burst-{i}")
        req.sampling.ignore_eos = True
        req.token_ids.ids.extend(PROMPT)
        with InferenceClient(cluster.addresses, max_attempts=1) as c:
            return sum(len(m.token_ids) for m in c.generate(req, timeout=180))

    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(over_http, i) for i in range(16)]
        futures += [pool.submit(over_grpc, i) for i in range(8)]
        done = [f.result(timeout=240) for f in futures]  # any 5xx / INTERNAL raises here
    assert done == [4] * 24
    # the decode nodes did refuse (6 staging pages hold 2 requests), and nothing failed
    assert router_metric(cluster, "kvflow_node_busy_total") > 0
    assert router_metric(cluster, "kvflow_node_failures_total") == 0


BURST = 48  # the decode nodes' staging holds 4 of these prompts at once
LONG_TOKENS = 24  # 40 + 24 tokens: 4 of a decode node's 6 KV pages; two outgrow them


def _prompts() -> list[list[int]]:
    rng = random.Random(26)
    return [[rng.randrange(3, 300) for _ in range(40)] for _ in range(6)]


def _references(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens, one request at a time on an engine of this process."""
    engine = Engine.open(model, EngineConfig(block_size=16, num_pages=64))
    params = SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True)
    return [engine.generate([ids], params)[0] for ids in prompts]


def test_burst_far_over_capacity_streams_the_references(
    cluster: LocalCluster, tiny_model: Path
) -> None:
    prompts = _prompts()
    want = _references(tiny_model, prompts)
    client = openai.OpenAI(
        base_url=cluster.http_urls[0] + "/v1", api_key="unused", max_retries=0, timeout=300
    )
    # each prompt's text alone on the quiet cluster: what every streamed copy must equal
    alone = [
        client.completions.create(
            model="tiny", prompt=ids, max_tokens=LONG_TOKENS, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for ids in prompts
    ]
    busy_before = router_metric(cluster, "kvflow_node_busy_total")

    def over_http(i: int) -> str:
        stream = client.completions.create(
            model="tiny",
            prompt=prompts[i % len(prompts)],
            max_tokens=LONG_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
        )  # an error event after the first token raises here
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    def over_grpc(i: int) -> list[int]:
        req = pb2.GenerateRequest(max_tokens=LONG_TOKENS, request_id=f"long-burst-{i}")
        req.sampling.ignore_eos = True
        req.token_ids.ids.extend(prompts[i % len(prompts)])
        with InferenceClient(cluster.addresses, max_attempts=1) as c:
            return [t for m in c.generate(req, timeout=300) for t in m.token_ids]

    with ThreadPoolExecutor(BURST) as pool:
        texts = [pool.submit(over_http, i) for i in range(BURST // 2)]
        tokens = [pool.submit(over_grpc, i) for i in range(BURST // 2, BURST)]
        got_text = [f.result(timeout=600) for f in texts]  # a 5xx / INTERNAL raises here
        got_tokens = [f.result(timeout=600) for f in tokens]
    for i, text in enumerate(got_text):
        assert text == alone[i % len(prompts)], f"HTTP request {i}"
    for i, ids in zip(range(BURST // 2, BURST), got_tokens, strict=True):
        assert ids == want[i % len(prompts)], f"gRPC request {i}"
    assert router_metric(cluster, "kvflow_node_busy_total") > busy_before  # it was over
    assert router_metric(cluster, "kvflow_node_failures_total") == 0
