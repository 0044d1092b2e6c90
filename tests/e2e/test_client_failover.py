"""Clients that survive a router loss, on a real cluster (1 metadata replica, 1 prefill node, 1
decode node, 2 routers with a key file): with router-0 SIGKILLed, `kvflow generate`, `kvflow
warmup`, `kvflow kvdb` and the Python InferenceClient, given both routers and an API key
(``--api-key`` or ``KVFLOW_API_KEY``), still succeed through router-1; a command given only
router-0 waits (connection refused, retried with backoff) until it is back. Before, only
`generate` and InferenceClient took several routers, and `generate` took no key.

The test process holds no cluster secret: a command without a key is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.security import SECRET_FILE_ENV
from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient
from kvflow.stages.api.failover import API_KEY_ENV
from kvflow.tools.cli import main
from kvflow.tools.supervise import LocalCluster
from tests.cluster_member import heal
from tests.docs.blocks import block

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

KEY = "carol-key-0123456789ab"
BLOCK = 16


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("client-failover")
    keyfile = data / "keys.txt"
    keyfile.write_text(f"{KEY} carol user\n")
    c = LocalCluster(
        data / "cluster",
        meta=1,
        prefill=1,
        decode=1,
        model=tiny_model,
        extra=("--block-size", str(BLOCK), "--num-pages", "128", "--dram-mb", "32"),
        router_extra=("--api-key-file", str(keyfile)),
        routers=2,
    )
    try:
        c.start(timeout_s=180)
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def whole(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    heal(cluster)


def generate_argv(servers: str, *extra: str) -> list[str]:
    return ["generate", "--server", servers, "--token-ids", "5,6,7,8,9", "--max-tokens", "3",
            "--ignore-eos", "--json", *extra]  # fmt: skip


def test_every_client_command_fails_over_to_the_other_router_with_an_api_key(
    cluster: LocalCluster,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    both = ",".join(cluster.addresses)  # router-0 first: every command tries it first
    cluster.kill("router-0")

    assert main(generate_argv(both, "--api-key", KEY)) == 0
    assert json.loads(capsys.readouterr().out)["completion_tokens"] == 3

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"hash_ids": [900 + 10 * i, 901 + 10 * i]})
                                for i in range(3)))  # fmt: skip
    argv = ["warmup", "--server", both, "--api-key", KEY, "--json", "submit", str(corpus)]
    assert main(argv) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["state"] == "done" and done["tenant"] == "carol", done

    assert main(["kvdb", "--server", both, "--api-key", KEY, "--json", "stats"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats, stats

    with InferenceClient(cluster.addresses, api_key=KEY) as client:
        req = pb2.GenerateRequest(max_tokens=2)
        req.token_ids.ids.extend(range(10, 40))
        msgs = list(client.generate(req, timeout=120))
        assert sum(len(m.token_ids) for m in msgs) == 2
        assert client.failovers == 1  # router-0 refused the connection, router-1 answered

    # the key from the environment, for every command
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert main(generate_argv(both)) == 0
    assert json.loads(capsys.readouterr().out)["completion_tokens"] == 3
    assert main(["warmup", "--server", both, "--json", "list"]) == 0
    assert done["job_id"] in {j["job_id"] for j in json.loads(capsys.readouterr().out)["jobs"]}

    # the control: without a key (no cluster secret either) the same command is refused
    monkeypatch.delenv(API_KEY_ENV)
    assert main(generate_argv(both)) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_a_command_given_only_the_dead_router_waits_until_it_is_back(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    a = cluster.addresses[0]
    cluster.kill("router-0")
    # started again at once (from this thread: a child dies with the thread that started it),
    # and the process takes seconds to listen: the command's first calls are refused
    cluster.restart("router-0")
    assert main(generate_argv(a, "--api-key", KEY)) == 0
    assert json.loads(capsys.readouterr().out)["completion_tokens"] == 3
    assert f"server {a} unavailable" in caplog.text  # refused first, retried with backoff
    assert main(["warmup", "--server", a, "--api-key", KEY, "--json", "list"]) == 0
    assert "jobs" in json.loads(capsys.readouterr().out)


def json_values(text: str) -> list[object]:
    """Every JSON value printed one after another (kvdb indents its output)."""
    decoder, values, rest = json.JSONDecoder(), [], text.strip()
    while rest:
        value, end = decoder.raw_decode(rest)
        values.append(value)
        rest = rest[end:].lstrip()
    return values


def test_the_documented_commands_fail_over_with_the_key_from_the_environment(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.kill("router-0")
    env = {k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}
    env.update(
        KVFLOW_ROUTERS=",".join(cluster.addresses),
        KVFLOW_API_KEY=KEY,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    shell = block("clients.md", "cli-failover")
    done = subprocess.run(
        ["bash", "-euc", shell], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    generated, jobs, stats = json_values(done.stdout)
    assert generated["completion_tokens"] >= 1 and "jobs" in jobs and stats
    script = tmp_path / "snippet.py"
    script.write_text(block("clients.md", "python-failover"))
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(" 1")  # text, then one failover (router-0 refused)
