"""Roles started one by one, as an operator on several hosts would (`kvflow serve --role ...`),
with no secret flag and no secret in the environment, for the fault-injection tests.

Every process is started in its own session and stopped by ``stop`` (SIGTERM, then SIGKILL),
also when a test fails (the fixtures call it in ``finally``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from kvflow.security import SECRET_FILE_ENV
from tests.conftest import pick_free_port


@dataclass
class Role:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = field(default=None, repr=False)

    def start(self, env: dict[str, str] | None = None) -> Role:
        base = {k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvflow.tools.cli", "serve", *self.argv],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**base, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for(self, text: str, timeout_s: float = 120.0) -> None:
        """Until ``text`` is in the role's output; AssertionError (with the output) when the
        process exits first or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {text!r} in {timeout_s}s:\n{self.output()}")
            time.sleep(0.1)

    def listening_ports(self) -> set[int]:
        """Every TCP port the process listens on (asked of the kernel, not of the flags)."""
        assert self.proc is not None
        return listening_ports(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        if self.log is not None:
            self.log.close()
            self.log = None


def listening_ports(pid: int) -> set[int]:
    """The TCP ports a process and its children listen on, read from /proc (psutil's
    ``net_connections`` trips over the ``socket.inet_ntop`` that pysyncobj replaces)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    inodes: set[str] = set()
    for proc in procs:
        fd_dir = Path(f"/proc/{proc.pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


def run_role(argv: list[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run a role that is expected to refuse to start; its exit code and output."""
    base = {k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}
    return subprocess.run(
        [sys.executable, "-m", "kvflow.tools.cli", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=base,
        check=False,
    )


class HandStartedRoles:
    """One metadata replica, a prefill and a decode node and a router, each a ``Role`` started
    by hand as an operator would (``kvflow serve --role ...``, no supervisor), on free ports
    with one data dir. ``metrics`` maps each role's name to its metrics port."""

    def __init__(
        self,
        root: Path,
        model: Path,
        small: list[str],
        router_extra: tuple[str, ...] = (),
        router_http_port: str | None = None,
    ) -> None:
        self.data_dir = root / "data"
        self.meta_grpc = f"127.0.0.1:{pick_free_port()}"
        self.router_port = pick_free_port()
        common = ["--data-dir", str(self.data_dir), "--model", str(model), *small]
        meta = [
            "--role", "meta", "--address", f"127.0.0.1:{pick_free_port()}",
            "--grpc-port", self.meta_grpc.rpartition(":")[2], "--data-dir", str(self.data_dir),
        ]  # fmt: skip
        self.roles = [Role("meta", meta, root / "meta.log")]
        for kind in ("prefill", "decode"):
            node = [
                "--role", "node", "--kind", kind, "--node-id", f"{kind}-0",
                "--port", str(pick_free_port()), "--meta", self.meta_grpc, *common,
            ]  # fmt: skip
            self.roles.append(Role(kind, node, root / f"{kind}.log"))
        http_port = router_http_port if router_http_port is not None else str(pick_free_port())
        router = [
            "--role", "router", "--meta", self.meta_grpc, "--port", str(self.router_port),
            "--http-port", http_port, *router_extra, *common,
        ]  # fmt: skip
        self.roles.append(Role("router", router, root / "router.log"))
        self.metrics: dict[str, int] = {}
        for role in self.roles:
            self.metrics[role.name] = pick_free_port()
            role.argv += ["--metrics-port", str(self.metrics[role.name])]
