"""The one rule that gives every role a cluster secret (kvflow/security/bootstrap.py), and the
refusals of a start that would be open: a role joining peers beyond loopback without the
secret, and an inference API beyond loopback without API keys (unless --insecure)."""

from __future__ import annotations

import argparse
import logging
import os
import stat
import threading
from pathlib import Path

import pytest

from kvflow.security import SECRET_FILE_ENV, generate_secret_file, load_secret_file
from kvflow.security.bootstrap import SecretRequiredError, is_loopback, resolve_secret
from kvflow.tools.args import check_api_exposure

from .roles import run_role

pytestmark = pytest.mark.faults


@pytest.fixture(autouse=True)
def _no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


def test_a_lone_role_generates_a_private_secret_and_reuses_it(tmp_path: Path) -> None:
    first = resolve_secret("embedded", tmp_path, None, binds=("127.0.0.1",))
    assert first.how == "generated" and first.path == (tmp_path / "cluster.secret").resolve()
    assert stat.S_IMODE(first.path.stat().st_mode) == 0o600
    value = load_secret_file(first.path).value
    again = resolve_secret("embedded", tmp_path, None, binds=("127.0.0.1",))
    assert again.how == "data dir" and load_secret_file(again.path).value == value


def test_roles_sharing_a_data_dir_agree_when_they_start_at_once(tmp_path: Path) -> None:
    values: list[bytes] = []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        source = resolve_secret("meta", tmp_path, None, ("127.0.0.1",), ("127.0.0.1:7101",))
        values.append(load_secret_file(source.path).value)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(values) == 8 and len(set(values)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.secret"]  # nothing left aside


def test_the_given_file_and_the_environment_come_first(tmp_path: Path, monkeypatch) -> None:
    given = tmp_path / "given.secret"
    env = tmp_path / "env.secret"
    generate_secret_file(given)
    generate_secret_file(env)
    monkeypatch.setenv(SECRET_FILE_ENV, str(env))
    assert resolve_secret("node", tmp_path, given).path == given.resolve()
    assert resolve_secret("node", tmp_path, None).how == "environment"
    assert not (tmp_path / "cluster.secret").exists()


def test_a_joiner_beyond_loopback_needs_the_secret(tmp_path: Path) -> None:
    with pytest.raises(SecretRequiredError, match="--cluster-secret-file"):
        resolve_secret("node", tmp_path, None, ("127.0.0.1",), ("10.0.0.7:7200",))
    with pytest.raises(SecretRequiredError, match=r"0\.0\.0\.0"):
        resolve_secret("meta", tmp_path, None, ("0.0.0.0",), ("127.0.0.1:7101",))
    assert not (tmp_path / "cluster.secret").exists()
    generate_secret_file(tmp_path / "cluster.secret")  # copied there by the operator
    source = resolve_secret("node", tmp_path, None, ("10.0.0.8",), ("10.0.0.7:7200",))
    assert source.how == "data dir"


def test_loopback_names() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("h1")


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["--role", "meta", "--address", "127.0.0.1:7100", "--peers", "10.9.8.7:7101"],
        ["--role", "meta", "--host", "0.0.0.0", "--address", "10.0.0.1:7100", "--peers", "h2:1"],
        ["--role", "node", "--meta", "10.9.8.7:7200"],
        ["--role", "router", "--meta", "10.9.8.7:7200"],
    ],
)
def test_a_process_joining_peers_beyond_loopback_refuses_in_one_line(
    tmp_path: Path, argv: list[str]
) -> None:
    done = run_role([*argv, "--data-dir", str(tmp_path), "--metrics-port", "0"])
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("kvflow serve:")]
    assert len(lines) == 1 and "--cluster-secret-file" in lines[0]
    assert not (tmp_path / "cluster.secret").exists()


@pytest.mark.slow
@pytest.mark.parametrize("role", ["embedded", "router"])
def test_an_api_beyond_loopback_needs_api_keys(tmp_path: Path, role: str) -> None:
    argv = ["--role", role, "--host", "0.0.0.0", "--data-dir", str(tmp_path)]
    if role == "router":
        argv += ["--meta", "127.0.0.1:1"]
        generate_secret_file(tmp_path / "cluster.secret")
    done = run_role(argv)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--api-key" in done.stdout and "--insecure" in done.stdout


def test_insecure_serves_open_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    args = argparse.Namespace(host="0.0.0.0", api_key=None, api_key_file=None, insecure=False)
    with pytest.raises(ValueError, match="API keys"):
        check_api_exposure(args)
    args.insecure = True
    with caplog.at_level(logging.WARNING):
        check_api_exposure(args)
    assert any("--insecure" in r.getMessage() for r in caplog.records)
    args.insecure, args.host, args.api_key = False, "10.0.0.1", "k" * 16
    check_api_exposure(args)  # keys given: fine


def test_the_secret_is_never_world_readable(tmp_path: Path) -> None:
    path = tmp_path / "cluster.secret"
    generate_secret_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        resolve_secret("embedded", tmp_path, None)
