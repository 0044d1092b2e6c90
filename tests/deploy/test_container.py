"""`make container-test`: the small overlay's topology (3 meta, 2 prefill, 1 decode, 2 routers)
as one podman pod from the image `make container-test` builds, each Kubernetes pod a container
started as its manifest starts it (tests/deploy/podman_pod.py). An OpenAI chat request through
a router, the nodes listed with `kvflow kvdb nodes`, a prefill node killed and the request
still served, a router stopped with SIGTERM exiting cleanly; then everything is removed.

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
url, key = sys.argv[1], sys.argv[2]
body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
    {"Content-Type": "application/json", "Authorization": "Bearer " + key})
with urllib.request.urlopen(req, timeout=120) as resp:
    print(json.dumps({"status": resp.status, "body": json.load(resp)}))
"""


def _chat(cluster: PodmanCluster, router: str) -> dict[str, Any]:
    url = f"http://{cluster.ips[router]}:8000"
    t0 = time.monotonic()
    out = cluster.client(["-c", CHAT, url, cluster.api_key], entrypoint="python3")
    assert out.returncode == 0, out.stdout + out.stderr
    answer: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    answer["seconds"] = round(time.monotonic() - t0, 2)
    print(f"chat via {router}: {json.dumps(answer)}", flush=True)
    assert answer["status"] == 200
    text = answer["body"]["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text.strip()
    return answer


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

        listed = cluster.client(
            [
                "kvdb",
                "--server",
                f"{cluster.ips['kvflow-router-0']}:50051",
                "--api-key",
                cluster.api_key,
                "nodes",
                "--json",
            ]
        )
        assert listed.returncode == 0, listed.stdout + listed.stderr
        print(f"kvflow kvdb nodes --json: {listed.stdout.strip()}", flush=True)
        nodes = {row["node"]: row for row in json.loads(listed.stdout)}
        assert set(nodes) == {"kvflow-prefill-0", "kvflow-prefill-1", "kvflow-decode-0"}
        assert all(".kvflow-" in row["address"] for row in nodes.values())  # stable DNS names

        podman("kill", "--signal", "KILL", "kvflow-prefill-0")
        print("killed kvflow-prefill-0", flush=True)
        for router in ("kvflow-router-0", "kvflow-router-1", "kvflow-router-0"):
            _chat(cluster, router)

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
