"""The two stores of `bench_mooncake`, behind the same Mooncake-style calls.

``kvflow``: ``kvflow.integrations.mooncake.MooncakeDistributedStore``, every store a cluster
member of a one-replica metadata group (``python -m kvflow.tools.meta``, a process, as
Mooncake's master is). ``mooncake``: the real ``mooncake.store.MooncakeDistributedStore``
(PyPI ``mooncake-transfer-engine-non-cuda``), its ``mooncake_master`` a process with
P2PHANDSHAKE metadata (no etcd, no HTTP metadata server). Everything binds and talks to
127.0.0.1 only.

Mooncake is optional: ``mooncake_missing()`` says why it cannot be used (and how to install
it), and the benchmark then measures kvflow alone.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.tools.args import free_port

SYSTEMS = ("kvflow", "mooncake")
HOST = "127.0.0.1"
MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
INSTALL_HINT = f"""\
Mooncake Store is an optional benchmark dependency (never a test dependency). To compare:
  pip download --no-deps {MOONCAKE_PACKAGE} -d /tmp/mc-dl
  pip install --no-deps --target /tmp/mooncake-site /tmp/mc-dl/mooncake_transfer_*.whl
  (cd /tmp/mc-dl && apt-get download libibverbs1 libnl-route-3-200 libnl-3-200 \\
     && for f in *.deb; do dpkg -x "$f" /tmp/mc-libs; done)
  export PYTHONPATH=/tmp/mooncake-site:$PYTHONPATH
  export LD_LIBRARY_PATH=/tmp/mc-libs/usr/lib/x86_64-linux-gnu:/tmp/mc-libs/lib/x86_64-linux-gnu
and run the benchmark again (its transfer engine runs over TCP; no RDMA device is needed)."""
MASTER_READY_S = 30.0


def mooncake_missing() -> str | None:
    """None if ``mooncake.store`` imports (with its shared libraries), else why not."""
    try:
        module = importlib.import_module("mooncake.store")
    except (ImportError, OSError) as exc:  # not installed, or libibverbs & co. not found
        return f"{type(exc).__name__}: {exc}"
    if not hasattr(module, "MooncakeDistributedStore"):
        return "mooncake.store has no MooncakeDistributedStore"
    if not _master_binary().exists():
        return f"no mooncake_master next to mooncake ({_master_binary()})"
    return None


def _master_binary() -> Path:
    import mooncake

    return Path(mooncake.__file__).parent / "mooncake_master"


@dataclass(frozen=True)
class Control:
    """Where a store of each system finds its control plane: kvflow's metadata replica
    (gRPC "host:port"), Mooncake's master ("host:port", None when Mooncake is skipped)."""

    kvflow_meta: str
    mooncake_master: str | None


@contextlib.contextmanager
def control_plane(with_mooncake: bool) -> Iterator[Control]:
    """Start kvflow's metadata replica and (``with_mooncake``) Mooncake's master; stop both
    on exit. Their logs go to a temporary directory (removed on exit)."""
    from kvflow.security import SECRET_FILE_ENV
    from kvflow.tools.supervise import LocalMetaProcesses

    with (
        tempfile.TemporaryDirectory(prefix="kvflow-bench-mooncake-") as tmp,
        LocalMetaProcesses(Path(tmp) / "meta", n=1) as meta,
    ):
        # The members (this process's and its children) hold the replica's secret, until the
        # control plane stops (then the previous value is put back).
        previous = os.environ.get(SECRET_FILE_ENV)
        os.environ.setdefault(SECRET_FILE_ENV, str(meta.secret_file))
        master: subprocess.Popen[bytes] | None = None
        address = None
        try:
            meta.start_all()
            if with_mooncake:
                master, address = _start_master(Path(tmp))
            yield Control(meta.grpc[0], address)
        finally:
            if master is not None:
                master.terminate()
                try:
                    master.wait(10)
                except subprocess.TimeoutExpired:
                    master.kill()
                    master.wait()
            if previous is None:
                os.environ.pop(SECRET_FILE_ENV, None)
            else:
                os.environ[SECRET_FILE_ENV] = previous


def _start_master(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = (tmp / "mooncake_master.log").open("wb")
    master = subprocess.Popen(
        [
            str(_master_binary()),
            f"--rpc_port={port}",
            f"--rpc_address={HOST}",
            f"--metrics_host={HOST}",
            f"--metrics_port={free_port()}",
            "--enable_metric_reporting=false",
            "--enable_http_metadata_server=false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + MASTER_READY_S
    import socket

    while True:
        if master.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {master.returncode}; see {log.name}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.2):
            return master, f"{HOST}:{port}"
        if time.monotonic() > deadline:
            master.kill()
            raise RuntimeError(f"mooncake_master did not listen on {HOST}:{port} in time")
        time.sleep(0.05)


def open_store(
    system: str, control: Control, segment_bytes: int, same_host_shm: bool = True
) -> Any:
    """A set-up store of ``system`` contributing ``segment_bytes`` (0: a pure reader) to its
    cluster; kvflow's with ``same_host_shm`` False reads its peers over tcp even on this host
    (as from another host). Raises RuntimeError if setup fails."""
    if system == "kvflow":
        from kvflow.integrations.mooncake import MooncakeDistributedStore

        store: Any = MooncakeDistributedStore()
        code = store.setup(
            {
                "local_hostname": HOST,
                "metadata_server": control.kvflow_meta,
                "global_segment_size": max(segment_bytes, 1 << 20),
                "protocol": "tcp",
                "kvflow_ssd_bytes": 0,
                "kvflow_heartbeat_s": 0.5,
                "kvflow_same_host_shm": same_host_shm,
            }
        )
    elif system == "mooncake":
        from mooncake.store import MooncakeDistributedStore as MooncakeStore

        assert control.mooncake_master is not None
        store = MooncakeStore()
        code = store.setup(
            HOST, "P2PHANDSHAKE", segment_bytes, 64 << 20, "tcp", "", control.mooncake_master
        )
    else:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    if code != 0:
        raise RuntimeError(f"{system} setup failed with {code}")
    return store


def values_for(size: int, count: int, seed: int) -> np.ndarray:
    """The benchmark's seeded values of one size, back to back (the same in every process)."""
    return np.random.default_rng([seed, size]).integers(0, 256, size * count, dtype=np.uint8)


def object_keys(prefix: str, size: int, count: int) -> list[str]:
    return [f"{prefix}-{size}-{i}" for i in range(count)]


def put_all(store: Any, keys: list[str], values: np.ndarray, size: int) -> float:
    """``batch_put_from`` every value (``values`` registered first); returns the seconds.
    Raises RuntimeError if any put failed."""
    base = values.ctypes.data
    ptrs = [base + i * size for i in range(len(keys))]
    start = time.perf_counter()
    codes = store.batch_put_from(keys, ptrs, [size] * len(keys))
    elapsed = time.perf_counter() - start
    bad = [c for c in codes if c != 0]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(keys)} puts failed (first code {bad[0]})")
    return elapsed


def holder_main(
    pipe: Connection, system: str, control: Control, sizes: list[int], counts: list[int], seed: int
) -> None:
    """A holder process: one store of ``system`` that puts every size's values under the
    "remote" prefix, reports ready, and serves them until the parent sends anything."""
    total = sum(s * c for s, c in zip(sizes, counts, strict=True))
    store = open_store(system, control, total + (64 << 20))
    kept = []
    try:
        for size, count in zip(sizes, counts, strict=True):
            values = values_for(size, count, seed)
            kept.append(values)
            if store.register_buffer(values.ctypes.data, values.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
            put_all(store, object_keys("remote", size, count), values, size)
        pipe.send("ready")
        pipe.recv()
    finally:
        store.close()
