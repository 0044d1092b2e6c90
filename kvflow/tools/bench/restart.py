"""Benchmark restart to serving: SIGKILL one process of a running cluster, start it again, time
until it serves again.

Starts a cluster as a library (LocalCluster: 3 metadata replicas, 1 prefill, 1 decode node and
1 router; the default model unless ``--model``). For each role in turn, ``--rounds`` times:

- **metadata follower / leader**: SIGKILL the replica, start it again from its journal; serving
  = its Status says ``ready`` (a leader is known and it has caught up);
- **prefill / decode node**: SIGKILL, wait until the router has seen it unhealthy (its
  heartbeats stopped), start it again; serving = the router's Stats show it healthy again;
- **router**: SIGKILL, start it again; serving = its Health says serving and it knows every
  node.

The clock runs from the restart (the new process's start) to serving; the time a node takes to
be noticed as gone is reported apart (``seen_down_s``). One summary line; ``--json PATH``
writes every round. Exits 1 if a role exceeds ``--target-s`` (median over its rounds).

    .venv/bin/python -m kvflow.tools.bench.restart [--model DIR] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from kvflow.replication.wire import pb2 as meta_pb2
from kvflow.replication.wire import pb2_grpc as meta_pb2_grpc
from kvflow.stages.api import pb2, pb2_grpc
from kvflow.stages.engine import write_demo_model
from kvflow.tools.supervise import LocalCluster, cluster_channel

ROLES = ("meta-follower", "meta-leader", "prefill-0", "decode-0", "router-0")
POLL_S = 0.02


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``check()`` is true (RPC errors count as false); RuntimeError past the
    deadline naming ``what``."""
    start = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - start
        except grpc.RpcError:
            pass
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(POLL_S)


class Probe:
    """The RPCs that say whether a process of ``cluster`` serves."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    def _channel(self, address: str) -> Any:
        return cluster_channel(address, self.cluster.secret, (), self.cluster.client_tls)

    def meta_ready(self, index: int) -> bool:
        with self._channel(self.cluster.meta_addresses[index]) as channel:
            stub = meta_pb2_grpc.MetadataServiceStub(channel)
            return bool(stub.Status(meta_pb2.StatusRequest(), timeout=2).ready)

    def node_healthy(self, name: str) -> bool | None:
        """The router's view of node ``name``: True / False, None when it does not list it."""
        with self._channel(self.cluster.address) as channel:
            stats = pb2_grpc.InferenceStub(channel).Stats(pb2.StatsRequest(), timeout=2)
        for instance in stats.instances:
            if instance.instance_id == name:
                return instance.values["healthy"] == 1.0
        return None

    def router_serving(self) -> bool:
        expected = self.cluster.expected
        with self._channel(self.cluster.address) as channel:
            health = pb2_grpc.InferenceStub(channel).Health(pb2.HealthRequest(), timeout=2)
        known = (len(health.prefill_instances), len(health.decode_instances))
        return bool(health.serving) and known == expected


def _round(cluster: LocalCluster, probe: Probe, role: str, timeout_s: float) -> dict[str, Any]:
    if role.startswith("meta"):
        leader = cluster.metadata_leader()
        metas = [n for n in cluster.procs if n.startswith("meta")]
        name = leader if role == "meta-leader" else next(n for n in metas if n != leader)
        if name is None:
            raise RuntimeError("no metadata leader")
        index = int(name.split("-")[1])
        cluster.kill(name)
        cluster.restart(name)
        serving = _until(lambda: probe.meta_ready(index), timeout_s, f"{name} ready")
        seen_down = 0.0
    elif role == "router-0":
        name = role
        cluster.kill(name)
        cluster.restart(name)
        serving = _until(probe.router_serving, timeout_s, "the router serving")
        seen_down = 0.0
    else:
        name = role
        cluster.kill(name)
        seen_down = _until(lambda: probe.node_healthy(name) is False, timeout_s, f"{name} down")
        cluster.restart(name)
        serving = _until(lambda: probe.node_healthy(name) is True, timeout_s, f"{name} healthy")
    cluster.wait_all(timeout_s)  # everything back before the next round
    return {"role": role, "process": name, "restart_to_serving_s": round(serving, 3),
            "seen_down_s": round(seen_down, 3)}  # fmt: skip


def medians_by_role(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Each role's median restart-to-serving time over its rounds."""
    roles = dict.fromkeys(r["role"] for r in rounds)
    return {
        role: statistics.median(r["restart_to_serving_s"] for r in rounds if r["role"] == role)
        for role in roles
    }


def missed(medians: dict[str, float], target_s: float) -> list[str]:
    """The roles whose median is over ``target_s``."""
    return [role for role, median in medians.items() if median > target_s]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="model directory (default: the tiny demo model)")
    p.add_argument("--rounds", type=int, default=3, help="kills per role")
    p.add_argument("--target-s", type=float, default=5.0, help="the median each role must meet")
    p.add_argument("--timeout-s", type=float, default=120.0, help="longest wait for one step")
    p.add_argument("--json", type=Path, help="write every round here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.target_s <= 0:
        p.error("--rounds must be >= 1 and --target-s > 0")
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvflow-restart-") as tmp:
        model = args.model or write_demo_model(Path(tmp) / "tiny", preset="tiny", seed=0)
        with LocalCluster(Path(tmp) / "cluster", meta=3, prefill=1, decode=1, model=model) as c:
            c.start(timeout_s=args.timeout_s)
            probe = Probe(c)
            for role in ROLES:
                for _ in range(args.rounds):
                    rounds.append(_round(c, probe, role, args.timeout_s))
    medians = medians_by_role(rounds)
    over = missed(medians, args.target_s)
    model_name = args.model.name if args.model else "tiny demo model"
    print(
        f"bench_restart ({model_name}, {args.rounds} rounds): restart to serving, median "
        + ", ".join(f"{role} {m:.2f}s" for role, m in medians.items())
        + f"; target {args.target_s:.1f}s: "
        + (f"missed by {', '.join(over)}" if over else "met by every role")
    )
    if args.json:
        doc = {"medians_s": medians, "target_s": args.target_s, "rounds": rounds}
        args.json.write_text(json.dumps(doc, indent=2))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
