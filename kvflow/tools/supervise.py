"""One process supervisor for everything tools/ starts: `kvflow cluster`, the benchmarks and
the real-process tests.

``Proc`` is one child process (a ``python -m MODULE ARGS`` command, its log file, its restart
bookkeeping). ``LocalCluster`` starts and supervises a whole cluster (metadata replicas, prefill
and decode nodes, routers) as ``kvflow serve --role ...`` processes on 127.0.0.1, restarting any
that dies (with a backoff for a crash loop). ``LocalMetaProcesses`` is a metadata group alone,
over the same ``Proc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc

from kvflow.replication.wire import pb2 as meta_pb2
from kvflow.replication.wire import pb2_grpc as meta_pb2_grpc
from kvflow.security import (
    SECRET_FILE_ENV,
    ClusterSecret,
    generate_secret_file,
    load_secret_file,
)
from kvflow.security.certs import local_certs
from kvflow.security.grpc_auth import cluster_channel
from kvflow.security.tls import ENV_NAMES as TLS_ENV_NAMES
from kvflow.security.tls import PLAINTEXT, TlsSettings
from kvflow.stages.api import pb2, pb2_grpc
from kvflow.stages.serve.ports import PortPicker

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child between fork and exec: ask the kernel for SIGTERM when the parent dies
    (also on SIGKILL of the supervisor), so no child outlives ``kvflow cluster``. Linux only
    (elsewhere a no-op). The signal follows the death of the *thread* that started the child:
    start children from a long-lived thread (the main one)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def cluster_secret_file(data_dir: Path) -> Path:
    """``<data_dir>/cluster.secret``, generated (0600) when absent: the secret of a local
    cluster, kept with its data so a restarted cluster keeps its journals' secret."""
    path = data_dir / "cluster.secret"
    if not path.exists():
        generate_secret_file(path)
    load_secret_file(path)  # refuse a short or world-readable file now, not in every child
    return path


# A process that ran this long before it died is restarted at once; one that dies sooner is
# crash-looping (a port in use, a bad flag): its restarts back off, doubling up to MAX.
STABLE_AFTER_S = 10.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
# A process that dies quickly this many times in a row with the same exit code and the same
# last line of output will fail the same way again (a data dir held by another process, a
# bad flag): it is not restarted, and the supervisor reports it (``Proc.failed``).
GIVE_UP_AFTER = 3
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:.,]+ ")  # a log record's time: not the cause


@dataclass
class Proc:
    """One supervised child: ``python -m <module> <args>``, output appended to ``log_path``.
    ``module`` defaults to the kvflow CLI's ``serve`` (``args`` are serve's flags)."""

    name: str
    args: list[str]
    log_path: Path
    module: tuple[str, ...] = ("kvflow.tools.cli", "serve")
    popen: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = field(default=None, repr=False)
    restarts: int = 0
    keep_down: bool = False
    started_at: float = 0.0
    backoff_s: float = 0.0
    restart_at: float | None = None  # when a dead process is due to start again
    secret_file: Path | None = None  # the cluster secret, passed by path in the environment
    tls: TlsSettings = PLAINTEXT  # the TLS files, passed by path in the environment
    quick_deaths: list[tuple[int | None, str]] = field(default_factory=list)
    failed: str | None = None  # why it is no longer restarted ("exit 1: <its last line>")
    log_offset: int = 0  # where this run's output starts in log_path

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.restart_at = None
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ)
        for name in (SECRET_FILE_ENV, *TLS_ENV_NAMES):  # the cluster's, not this process's
            env.pop(name, None)
        if self.secret_file is not None:
            env[SECRET_FILE_ENV] = str(self.secret_file)
        env.update(self.tls.env())
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *self.module, *self.args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            preexec_fn=die_with_parent,
        )

    def last_line(self) -> str:
        """The last non-empty line this run wrote (at most 300 characters), or ''."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(self.log_offset, self.log_path.stat().st_size - 64 * 1024))
                tail = f.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [_STAMP.sub("", line).strip() for line in tail.splitlines()]
        lines = [line for line in lines if line]
        return lines[-1][:300] if lines else ""

    def status(self) -> str:
        """'running', 'failed: <why>', 'restarting', 'down' or 'not started'."""
        if self.failed is not None:
            return f"failed: {self.failed}"
        if self.alive():
            return "running"
        if self.popen is None:
            return "not started"
        return "down" if self.keep_down else "restarting"

    def kill(self) -> None:
        """SIGKILL (a failure test) and reap."""
        self.stop(signal.SIGKILL)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets open and answers nothing (a hung peer)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT (harmless on a process that is not stopped)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.resume()  # a stopped process would not act on SIGTERM
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        if self.log is not None:
            self.log.close()
            self.log = None


def check_port_base(base: int) -> None:
    """ValueError unless ``base`` is 0 (free ports) or a port in [1024, 65535]."""
    if base and not 1024 <= base <= 65535:
        raise ValueError(f"--port-base must be 0 or in [1024, 65535], got {base}")


class ClusterPorts:
    """Where each port of a local cluster comes from: ``base`` 0 picks free ports (distinct,
    ``PortPicker``); otherwise ``base``, ``base + 1``, ... in the order the ports are asked
    for, which ``LocalCluster`` fixes (docs/cluster.md has the table): per metadata replica
    Raft, gRPC, metrics; per node (prefill ones, then decode) gRPC, transfer, metrics; per
    router metrics, then its gRPC and HTTP ports when those flags are 0."""

    def __init__(self, host: str, base: int = 0) -> None:
        check_port_base(base)
        self._picker = PortPicker(host)
        self._next = base

    def __call__(self) -> int:
        if not self._next:
            return self._picker()
        port, self._next = self._next, self._next + 1
        if port > 65535:
            raise ValueError("--port-base: the cluster's ports run past 65535; lower it")
        return port


def _given(args: Sequence[str], flag: str) -> bool:
    """Whether ``flag`` is among ``args`` (``--flag V`` or ``--flag=V``)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _node_dram_mb(nodes: int) -> str:
    """Each node's ``--dram-mb`` when ``nodes`` share this host (`memory.default_dram_bytes`;
    imported here, not at the top: it reads the host's memory through the engine package)."""
    from kvflow.stages.engine.meminfo import available_at_start
    from kvflow.stages.serve.memory import MIB, default_dram_bytes

    return str(default_dram_bytes(nodes, available_at_start()) // MIB)


class LocalCluster:
    """``meta`` replicas, ``prefill`` and ``decode`` nodes and ``routers`` routers, every
    process listening on ``host`` (127.0.0.1). ``address`` is the first router's,
    ``addresses`` every router's.

    Ports: the routers' gRPC on ``port``, ``port + 1``, ... and their HTTP (OpenAI, SGLang
    APIs) on ``http_port``, ``http_port + 1``, ...; everything else from ``port_base``
    (``ClusterPorts``); each of the three, when 0, takes free ports.
    ``api_key_file``: handed to every router (``--api-key-file``): clients then need a key.

    ``secure`` (default): every process gets the cluster secret ``secret_file``
    (``cluster_secret_file``) by path; ``secret`` is it, for this process's own calls.
    ``tls``: every gRPC and HTTP port serves TLS with a certificate for 127.0.0.1/localhost
    signed by a local CA (``<data_dir>/tls/``, ``security.certs.local_certs``) and every
    process verifies its peers with that CA; ``client_tls`` is what a client of this cluster
    needs (the CA), ``http_urls`` are https."""

    def __init__(
        self,
        data_dir: Path,
        meta: int = 3,
        prefill: int = 2,
        decode: int = 1,
        model: Path | None = None,
        port: int = 0,
        extra: tuple[str, ...] = (),
        router_extra: tuple[str, ...] = (),
        routers: int = 1,
        secure: bool = True,
        tls: bool = False,
        host: str = "127.0.0.1",
        http_port: int = 0,
        port_base: int = 0,
        api_key_file: Path | None = None,
    ) -> None:
        if min(meta, prefill, decode, routers) < 1:
            raise ValueError("a cluster needs at least one of each: meta, prefill, decode, router")
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.secret_file = cluster_secret_file(self.data_dir) if secure else None
        self.secret: ClusterSecret | None = (
            None if self.secret_file is None else load_secret_file(self.secret_file)
        )
        self.tls = PLAINTEXT
        if tls:
            certs = local_certs(self.data_dir / "tls")
            self.tls = TlsSettings(certs.cert_file, certs.key_file, certs.ca_file)
        self.client_tls = TlsSettings(ca_file=self.tls.ca_file)
        self._port = ClusterPorts(host, port_base)
        common = ["--host", host, "--data-dir", str(self.data_dir), *extra]
        if model is not None:
            common += ["--model", str(model)]
        self.procs: dict[str, Proc] = {}
        self.metrics_ports: dict[str, int] = {}
        rafts: list[str] = []
        grpcs: list[int] = []
        meta_metrics: list[int] = []
        for _ in range(meta):
            rafts.append(f"{host}:{self._port()}")
            grpcs.append(self._port())
            meta_metrics.append(self._port())
        self.meta_addresses = [f"{host}:{p}" for p in grpcs]
        for i, raft in enumerate(rafts):
            peers = ",".join(r for r in rafts if r != raft)
            self._add(
                f"meta-{i}",
                [
                    "--role",
                    "meta",
                    "--meta-id",
                    str(i),
                    "--address",
                    raft,
                    "--peers",
                    peers,
                    "--grpc-port",
                    str(grpcs[i]),
                    "--raft-min-timeout-s",
                    "0.3",
                    "--raft-max-timeout-s",
                    "0.8",
                    *common,
                ],
                meta_metrics[i],
            )
        meta_list = ",".join(self.meta_addresses)
        # The nodes share this host's memory: their DRAM tiers together take the quarter of
        # it that one process's shards would (each node alone would plan a quarter for its own).
        node_extra = (
            [] if _given(extra, "--dram-mb") else ["--dram-mb", _node_dram_mb(prefill + decode)]
        )
        self.node_ports: dict[str, int] = {}
        self.transfer_ports: dict[str, int] = {}  # 0: any free port, chosen by the node
        for kind, n in (("prefill", prefill), ("decode", decode)):
            for i in range(n):
                name = f"{kind}-{i}"
                self.node_ports[name] = self._port()
                self.transfer_ports[name] = self._port() if port_base else 0
                self._add(
                    name,
                    [
                        "--role",
                        "node",
                        "--kind",
                        kind,
                        "--node-id",
                        name,
                        "--port",
                        str(self.node_ports[name]),
                        "--transfer-port",
                        str(self.transfer_ports[name]),
                        "--meta",
                        meta_list,
                        *common,
                        *node_extra,
                    ],
                    self._port(),
                )
        self.expected = (prefill, decode)
        router_metrics = [self._port() for _ in range(routers)]
        self.router_ports = [port + i if port else self._port() for i in range(routers)]
        self.port = self.router_ports[0]
        self.addresses = [f"{host}:{p}" for p in self.router_ports]
        self.address = self.addresses[0]
        # Each router's HTTP front (OpenAI, SGLang APIs).
        self.http_ports = [http_port + i if http_port else self._port() for i in range(routers)]
        scheme = "https" if tls else "http"
        self.http_urls = [f"{scheme}://{host}:{p}" for p in self.http_ports]
        keys = () if api_key_file is None else ("--api-key-file", str(api_key_file))
        for i, router_port in enumerate(self.router_ports):
            self._add(
                f"router-{i}",
                [
                    "--role",
                    "router",
                    "--port",
                    str(router_port),
                    "--http-port",
                    str(self.http_ports[i]),
                    "--meta",
                    meta_list,
                    *keys,
                    *common,
                    *router_extra,
                ],
                router_metrics[i],
            )

    def _add(self, name: str, args: list[str], metrics_port: int) -> None:
        """One supervised process, with its Prometheus port (``metrics_ports``) and the
        cluster secret's path."""
        self.metrics_ports[name] = metrics_port
        args = [*args, "--metrics-port", str(self.metrics_ports[name])]
        self.procs[name] = Proc(
            name,
            args,
            self.data_dir / f"{name}.log",
            secret_file=self.secret_file,
            tls=self.tls,
        )

    def start(self, timeout_s: float = 120.0) -> None:
        """Start everything (meta first, routers last) and wait until every router serves."""
        order = [p for p in self.procs.values() if p.name.startswith("meta")]
        order += [p for p in self.procs.values() if not p.name.startswith(("meta", "router"))]
        order += [p for p in self.procs.values() if p.name.startswith("router")]
        for proc in order:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for address in self.addresses:
            self.wait_serving(max(1.0, deadline - time.monotonic()), address)

    def wait_serving(self, timeout_s: float, address: str | None = None) -> None:
        """Until the router at ``address`` (the first) knows every node and all are healthy."""
        deadline = time.monotonic() + timeout_s
        with cluster_channel(address or self.address, self.secret, (), self.client_tls) as channel:
            stub = pb2_grpc.InferenceStub(channel)
            while True:
                try:
                    health = stub.Health(pb2.HealthRequest(), timeout=2)
                    known = (len(health.prefill_instances), len(health.decode_instances))
                    if health.serving and known == self.expected:
                        stats = stub.Stats(pb2.StatsRequest(), timeout=2)
                        if all(i.values["healthy"] == 1.0 for i in stats.instances):
                            return  # the router serves and every node is known and healthy
                except grpc.RpcError:
                    pass
                dead = [p.name for p in self.procs.values() if not p.alive() and not p.keep_down]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"cluster did not start (exited: {dead}); logs in {self.data_dir}"
                    )
                time.sleep(0.3)

    def wait_all(self, timeout_s: float) -> None:
        """Until every process runs again (``supervise_once`` restarts crashed ones; call it
        meanwhile) and every router knows every node as healthy."""
        deadline = time.monotonic() + timeout_s
        while any(not p.alive() and not p.keep_down for p in self.procs.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes did not come back; logs in {self.data_dir}")
            time.sleep(0.2)
        for address in self.addresses:
            self.wait_serving(max(1.0, deadline - time.monotonic()), address)

    def kill(self, name: str, keep_down: bool = True) -> None:
        """SIGKILL one process (a failure test). ``keep_down=False``: a crash, which
        ``supervise_once`` restarts."""
        proc = self.procs[name]
        proc.keep_down = keep_down
        proc.stop(signal.SIGKILL)

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[Proc]:
        """SIGSTOP one process for the ``with`` block (a hung-peer test); SIGCONT at its end,
        however it ends."""
        proc = self.procs[name]
        proc.pause()
        try:
            yield proc
        finally:
            proc.resume()

    def metadata_leader(self) -> str | None:
        """The name of the metadata replica that says it leads, or None."""
        for i, address in enumerate(self.meta_addresses):
            if not self.procs[f"meta-{i}"].alive():
                continue
            with cluster_channel(address, self.secret, (), self.client_tls) as channel:
                stub = meta_pb2_grpc.MetadataServiceStub(channel)
                try:
                    if stub.Status(meta_pb2.StatusRequest(), timeout=5).is_leader:
                        return f"meta-{i}"
                except grpc.RpcError:
                    continue
        return None

    def restart(self, name: str) -> None:
        """Start a process killed with ``kill`` again (same arguments, ports and data)."""
        proc = self.procs[name]
        proc.stop()
        proc.keep_down = False
        proc.failed = None
        proc.quick_deaths.clear()
        proc.restarts += 1
        proc.start()

    def heal(self, timeout_s: float) -> list[str]:
        """Start again every process that is not running (killed on purpose or crashed) and
        wait until every router knows every node as healthy: a shared cluster after a failure
        test, whatever that test left. Returns the names started again (none: quick)."""
        down = [name for name, proc in self.procs.items() if not proc.alive()]
        for name in down:
            self.restart(name)
        self.wait_all(timeout_s)
        return down

    def supervise_once(self, now: float | None = None) -> list[str]:
        """Restart the processes that died (``supervise``). Returns the names restarted now."""
        return supervise(self.procs.values(), now)

    def failed(self) -> dict[str, str]:
        """The processes the supervisor gave up on, and why."""
        return {name: p.failed for name, p in self.procs.items() if p.failed is not None}

    def status(self) -> dict[str, str]:
        """Every process's ``Proc.status``."""
        return {name: p.status() for name, p in self.procs.items()}

    def stop(self) -> None:
        """SIGTERM routers, then nodes (they flush their holdings to the metadata), then the
        metadata replicas; SIGKILL what does not exit in time."""
        routers = [n for n in self.procs if n.startswith("router")]
        metas = [n for n in self.procs if n.startswith("meta")]
        nodes = [n for n in self.procs if n not in routers and n not in metas]
        for name in [*routers, *nodes, *metas]:
            self.procs[name].stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def supervise(procs: Iterable[Proc], now: float | None = None) -> list[str]:
    """Restart the processes that died without being killed on purpose: at once if they had
    run ``STABLE_AFTER_S``, else after a backoff that doubles with each quick death; after
    ``GIVE_UP_AFTER`` quick deaths in a row with one exit code and one last output line, not
    at all (``Proc.failed`` says why; logged once). Returns the names restarted now."""
    now = time.monotonic() if now is None else now
    restarted = []
    for proc in procs:
        if proc.alive() or proc.keep_down or proc.popen is None:
            continue
        if proc.restart_at is None:  # a death not seen before
            code = proc.popen.poll()
            quick = now - proc.started_at < STABLE_AFTER_S
            if not quick:
                proc.quick_deaths.clear()
            else:
                proc.quick_deaths.append((code, proc.last_line()))
                recent = proc.quick_deaths[-GIVE_UP_AFTER:]
                if len(recent) == GIVE_UP_AFTER and len(set(recent)) == 1:
                    proc.failed = f"exit {code}: {recent[0][1] or '(no output)'}"
                    proc.keep_down = True
                    logger.error(
                        "%s failed %d times in a row the same way (%s); not restarting it "
                        "(log: %s)",
                        proc.name,
                        GIVE_UP_AFTER,
                        proc.failed,
                        proc.log_path,
                    )
                    continue
            proc.backoff_s = (
                min(MAX_BACKOFF_S, max(FIRST_BACKOFF_S, 2 * proc.backoff_s)) if quick else 0.0
            )
            proc.restart_at = now + proc.backoff_s
            logger.warning(
                "%s exited with %s; restarting it%s (log: %s)",
                proc.name,
                code,
                f" in {proc.backoff_s:.1f} s" if proc.backoff_s else "",
                proc.log_path,
            )
        if now >= proc.restart_at:
            proc.stop()
            proc.restarts += 1
            proc.start()
            restarted.append(proc.name)
    return restarted


class LocalMetaProcesses:
    """``n`` replica processes of one metadata group on this host (benchmarks, tests): free
    loopback ports, journals under ``data_dir``, output appended to ``<data_dir>/meta-<i>.log``.

    ``start(i)``/``kill(i)`` (SIGKILL)/``stop_all()`` (SIGTERM, then SIGKILL). Not
    thread-safe. Use as a context manager to stop every process on exit.
    """

    def __init__(self, data_dir: Path, n: int = 3, extra_args: Sequence[str] = ()) -> None:
        if n < 1:
            raise ValueError(f"n: expected >= 1 replicas, got {n}")
        self.data_dir = data_dir
        # This process's secret when it has one (its clients then reach the group), else the
        # group's own, generated under data_dir.
        own = os.environ.get(SECRET_FILE_ENV)
        self.secret_file = Path(own) if own else cluster_secret_file(data_dir)
        port = PortPicker()  # every port of the group distinct
        self.raft = [f"127.0.0.1:{port()}" for _ in range(n)]
        self.grpc = [f"127.0.0.1:{port()}" for _ in range(n)]
        self.procs = [
            Proc(
                f"meta-{i}",
                [
                    "--meta-id",
                    str(i),
                    "--address",
                    raft,
                    "--peers",
                    ",".join(r for r in self.raft if r != raft),
                    "--data-dir",
                    str(data_dir),
                    "--grpc-port",
                    self.grpc[i].rpartition(":")[2],
                    *extra_args,
                ],
                data_dir / f"meta-{i}.log",
                module=("kvflow.tools.meta",),
                secret_file=self.secret_file,
            )
            for i, raft in enumerate(self.raft)
        ]

    def start(self, i: int) -> None:
        if self.procs[i].alive():
            raise RuntimeError(f"replica {i} is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.procs[i].start()

    def start_all(self) -> None:
        for i in range(len(self.procs)):
            self.start(i)

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i`` (if running) and reap it."""
        self.procs[i].kill()

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.alive() and proc.popen is not None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.stop(timeout=5.0)

    def __enter__(self) -> LocalMetaProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
