"""`make container-test`: the small overlay's topology (3 meta, 2 prefill, 1 decode, 2 routers)
as one podman pod from the image `make container-test` builds, each Kubernetes pod a container
started as its manifest starts it (tests/deploy/podman_pod.py). An OpenAI chat request through
each router, the nodes listed with `kvflow kvdb nodes`, a prefill node killed and the request
still served; that node and a metadata replica brought back on other addresses under their
stable names, rejoining by themselves (the node serves again, the replica catches up); a
router stopped with SIGTERM exiting cleanly; then everything is removed.

Opt-in (KVFLOW_CONTAINER_TEST=1; the Makefile target sets it): it needs podman and the image,
and takes minutes and several GB of memory.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.manifests import kubectl, render
from tests.deploy.podman_pod import IMAGE, PodmanCluster, podman

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
    pytest.mark.skipif(
        os.environ.get("KVFLOW_CONTAINER_TEST") != "1",
        reason="opt-in: make container-test (builds the image with podman, runs the pod)",
    ),
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed"),
    pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed"),
    pytest.mark.timeout(1800),
]

CHAT = """
import json, sys, urllib.request
url, key, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": prompt}]}
req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
    {"Content-Type": "application/json", "Authorization": "Bearer " + key})
with urllib.request.urlopen(req, timeout=120) as resp:
    print(json.dumps({"status": resp.status, "body": json.load(resp)}))
"""


META_STATE = """
import sys, urllib.request
for name in sys.argv[1:]:
    text = urllib.request.urlopen(f"http://{name}:9466/metrics", timeout=10).read().decode()
    values = dict(line.split()[:2] for line in text.splitlines() if line.startswith("kvflow_"))
    print(name.split(".")[0], values["kvflow_meta_is_leader"], values["kvflow_meta_blocks"])
"""
QUESTION = "What is the capital of France?"


def _long_prompt(seed: int) -> str:
    """A prompt of several full KV blocks (new blocks for the metadata group to record)."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    return " ".join(f"{words[(i * 7 + seed) % 8]}{seed}" for i in range(300)) + " Summarise."


def _chat(cluster: PodmanCluster, router: str, prompt: str = QUESTION) -> dict[str, Any]:
    url = f"http://{cluster.ips[router]}:8000"
    t0 = time.monotonic()
    out = cluster.client(["-c", CHAT, url, cluster.api_key, prompt], entrypoint="python3")
    assert out.returncode == 0, out.stdout + out.stderr
    answer: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    answer["seconds"] = round(time.monotonic() - t0, 2)
    print(f"chat via {router}: {json.dumps(answer)}", flush=True)
    assert answer["status"] == 200
    text = answer["body"]["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text.strip()
    return answer


def _nodes(cluster: PodmanCluster) -> dict[str, dict[str, Any]]:
    """``kvflow kvdb nodes --json`` through router 0 (an admin key)."""
    router = f"{cluster.ips['kvflow-router-0']}:50051"
    argv = ["kvdb", "--server", router, "--api-key", cluster.api_key, "nodes", "--json"]
    listed = cluster.client(argv)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    print(f"kvflow kvdb nodes --json: {listed.stdout.strip()}", flush=True)
    return {row["node"]: row for row in json.loads(listed.stdout)}


def _meta_agree(cluster: PodmanCluster, deadline_s: float = 120.0) -> None:
    """Until every replica records the same number of blocks (more than none) and one leads."""
    names = [cluster.stable_name(p) for p in cluster.pods if p.component == "meta"]
    end = time.monotonic() + deadline_s
    while True:
        out = cluster.client(["-c", META_STATE, *[n for n in names if n]], entrypoint="python3")
        rows = [line.split() for line in out.stdout.splitlines()]
        leaders = sum(float(r[1]) == 1.0 for r in rows)
        blocks = {r[2] for r in rows}
        if out.returncode == 0 and leaders == 1 and len(blocks) == 1 and float(*blocks) > 0:
            print(f"metadata replicas (name, leader, blocks): {rows}", flush=True)
            return
        assert time.monotonic() < end, f"replicas disagree: {out.stdout}{out.stderr}"
        time.sleep(3.0)


def test_small_topology_in_one_podman_pod(tmp_path: Path) -> None:
    image = podman("image", "exists", IMAGE, check=False)
    assert image.returncode == 0, f"build the image first ({IMAGE}): make container-test"
    cluster = PodmanCluster(render("small"), tmp_path / "cluster")
    t0 = time.monotonic()
    try:
        took = cluster.start()
        print(f"healthy after (s): {json.dumps({k: round(v, 1) for k, v in took.items()})}")

        _chat(cluster, "kvflow-router-0")
        _chat(cluster, "kvflow-router-1")

        nodes = _nodes(cluster)
        assert set(nodes) == {"kvflow-prefill-0", "kvflow-prefill-1", "kvflow-decode-0"}
        assert all(".kvflow-" in row["address"] for row in nodes.values())  # stable DNS names

        podman("kill", "--signal", "KILL", "kvflow-prefill-0")
        print("killed kvflow-prefill-0", flush=True)
        for router in ("kvflow-router-0", "kvflow-router-1", "kvflow-router-0"):
            _chat(cluster, router)

        # prefill-0 comes back on another address under its stable name, by itself; with
        # prefill-1 killed, only it can serve the next request.
        cluster.move("kvflow-prefill-0", "127.77.0.60")
        podman("start", "kvflow-prefill-0")
        cluster.wait_healthy("kvflow-prefill-0", 600)
        # it registered again: its transfer endpoint is the new address (the name resolved)
        assert _nodes(cluster)["kvflow-prefill-0"]["address"].endswith("|127.77.0.60:7300")
        podman("kill", "--signal", "KILL", "kvflow-prefill-1")
        print("kvflow-prefill-0 back at 127.77.0.60; killed kvflow-prefill-1", flush=True)
        _chat(cluster, "kvflow-router-0")
        _chat(cluster, "kvflow-router-0", _long_prompt(1))

        # meta-0 likewise: killed, back on another address with its journal; the group
        # replicates new entries to it there.
        podman("kill", "--signal", "KILL", "kvflow-meta-0")
        cluster.move("kvflow-meta-0", "127.77.0.61")
        podman("start", "kvflow-meta-0")
        cluster.wait_healthy("kvflow-meta-0", 300)
        print("kvflow-meta-0 back at 127.77.0.61", flush=True)
        _chat(cluster, "kvflow-router-0", _long_prompt(2))
        _meta_agree(cluster)

        # SIGTERM through tini reaches kvflow, which shuts down and exits 0.
        stopped = podman("stop", "-t", "30", "kvflow-router-1", timeout=60)
        code = podman("inspect", "--format", "{{.State.ExitCode}}", "kvflow-router-1").stdout
        logs = cluster.logs("kvflow-router-1", tail=5)
        print(f"router-1 stopped ({stopped.stdout.strip()}): exit {code.strip()}; {logs!r}")
        assert code.strip() == "0" and "kvflow: shutting down" in logs
        _chat(cluster, "kvflow-router-0")
    except BaseException:
        for name in cluster.started:
            print(f"--- {name}\n{cluster.logs(name)}")
        raise
    finally:
        cluster.close()
        print(f"total {time.monotonic() - t0:.1f}s (pod removed)")
    gone = podman("pod", "exists", cluster.name, check=False)
    assert gone.returncode != 0
