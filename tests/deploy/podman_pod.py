"""The small overlay run as one podman pod: each Kubernetes pod of the rendered manifests is a
container of the image, started with the command, environment, volumes, init container and
security settings its manifest gives it (``manifests.pod_env`` / ``pod_argv``).

What stands in for the cluster: every pod gets its own loopback address (127.77.0.N; the
podman pod's containers share one network namespace with no outside network), a hosts file
maps the StatefulSets' stable DNS names to those addresses, host folders stand in for
emptyDir volumes and volume claims (owned by the image's user, 10001), a tmpfs for /dev/shm,
and folders holding files owned by root, group-readable by 10001 (mode 0440), for the Secret
volumes, as the kubelet writes them with ``fsGroup``.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.manifests import (
    Pod,
    by_kind,
    pod_argv,
    pod_env,
    pods,
    quantity_bytes,
    volume_mounts,
    workloads,
)

IMAGE = os.environ.get("KVFLOW_IMAGE", "localhost/kvflow:dev")
USER = "10001:10001"
NAMESPACE = "kvflow"


def podman(
    *args: str, timeout: float = 120.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=check
    )


@dataclass
class PodmanCluster:
    """``start()`` every pod of ``objs`` in order (meta, nodes, routers), each once healthy;
    ``close()`` removes the podman pod and the folders. ``api_key`` is an admin key."""

    objs: list[dict[str, Any]]
    root: Path
    name: str = "kvflow-small"
    api_key: str = field(default_factory=lambda: secrets.token_hex(16))
    ips: dict[str, str] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.configmaps = by_kind(self.objs, "ConfigMap")
        self.pods: list[Pod] = []
        n = 10
        for workload in workloads(self.objs):
            for pod in pods(workload, NAMESPACE):
                self.ips[pod.name] = f"127.77.0.{n}"
                n += 1
        for workload in workloads(self.objs):
            self.pods += pods(workload, NAMESPACE, self.ips)

    # -- files standing in for the cluster ------------------------------------------------------
    def stable_name(self, pod: Pod) -> str | None:
        service = pod.workload["spec"].get("serviceName")
        domain = self.configmaps["kvflow-config"]["data"]["CLUSTER_DOMAIN"]
        return f"{pod.name}.{service}.{NAMESPACE}.svc.{domain}" if service else None

    def _write_hosts(self) -> None:
        """The cluster DNS: every StatefulSet pod's stable name -> its address. Rewritten in
        place (the containers bind-mount this one file)."""
        lines = ["127.0.0.1 localhost"]
        for pod in self.pods:
            name = self.stable_name(pod)
            if name:
                lines.append(f"{self.ips[pod.name]} {name} {pod.name}")
        hosts = self.root / "hosts"
        with open(hosts, "r+" if hosts.exists() else "w") as handle:
            handle.truncate(0)
            handle.write("\n".join(lines) + "\n")
        hosts.chmod(0o644)

    def move(self, pod_name: str, ip: str) -> None:
        """The pod's stable name now resolves to ``ip`` (a pod rescheduled elsewhere); start
        its container again (``podman start``) to bring it back there."""
        self.ips[pod_name] = ip
        self._write_hosts()

    def _write_files(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_hosts()
        self._secret("kvflow-cluster-secret", "cluster-secret", secrets.token_hex(32) + "\n")
        self._secret("kvflow-api-keys", "api-keys", f"{self.api_key} - admin\n")

    def _secret(self, name: str, key: str, value: str) -> None:
        folder = self.root / "secrets" / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / key
        path.write_text(value)
        os.chown(path, 0, 10001)
        path.chmod(0o440)

    def _own_folder(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, 10001, 10001)
        return path

    def _volume_flags(self, pod: Pod, container: dict[str, Any]) -> list[str]:
        flags: list[str] = []
        for mount_path, volume in volume_mounts(pod, container).items():
            mount = next(m for m in container["volumeMounts"] if m["mountPath"] == mount_path)
            mode = "ro" if mount.get("readOnly") else "rw"
            if "secret" in volume:
                src = self.root / "secrets" / volume["secret"]["secretName"]
                flags += ["-v", f"{src}:{mount_path}:ro"]
            elif mount_path == "/dev/shm":
                size = quantity_bytes(volume["emptyDir"]["sizeLimit"])
                flags += ["--shm-size", str(size)]
            else:  # emptyDir or a volume claim: a folder of this pod's
                src = self._own_folder(
                    self.root / "pods" / pod.name / volume.get("name", mount["name"])
                )
                flags += ["-v", f"{src}:{mount_path}:{mode}"]
        return flags

    def _security_flags(self) -> list[str]:
        return [
            "--user",
            USER,
            "--read-only",
            "--cap-drop",
            "ALL",
            "--security-opt",
            "no-new-privileges",
        ]

    # -- the run --------------------------------------------------------------------------------
    def start(self, deadline_s: float = 600.0) -> dict[str, float]:
        """Start the pods (meta, then prefill and decode, then routers), each group waited
        healthy before the next starts; returns each group's seconds to healthy."""
        self._write_files()
        podman("pod", "rm", "-f", "--ignore", self.name, check=False)
        podman("pod", "create", "--name", self.name, "--network", "none", "--share", "net")
        took: dict[str, float] = {}
        for group in (("meta",), ("prefill", "decode"), ("router",)):
            t0 = time.monotonic()
            members = [p for p in self.pods if p.component in group]
            for pod in members:
                self._run_pod(pod)
            for pod in members:
                self.wait_healthy(pod.name, deadline_s)
            took["+".join(group)] = time.monotonic() - t0
        return took

    def _run_pod(self, pod: Pod) -> None:
        common = ["--pod", self.name, "-v", f"{self.root / 'hosts'}:/etc/hosts:ro"]
        for init in pod.spec.get("initContainers", []):
            env = pod_env(pod, init, self.configmaps)
            argv = pod_argv(init, env)
            podman(
                "run",
                "--rm",
                *common,
                *self._security_flags(),
                *self._volume_flags(pod, init),
                "--entrypoint",
                argv[0],
                IMAGE,
                *argv[1:],
            )
        c = pod.spec["containers"][0]
        env = pod_env(pod, c, self.configmaps)
        argv = pod_argv(c, env)
        assert argv[0] == "kvflow" and not c.get("command"), argv
        env_flags = [f"--env={k}={v}" for k, v in env.items()]
        limit = c["resources"]["limits"]["memory"]
        podman(
            "run",
            "-d",
            "--name",
            pod.name,
            *common,
            *self._security_flags(),
            *self._volume_flags(pod, c),
            *env_flags,
            "--memory",
            str(quantity_bytes(limit)),
            "--health-interval",
            "disable",
            IMAGE,
            *argv[1:],
        )
        self.started.append(pod.name)

    def wait_healthy(self, name: str, deadline_s: float) -> None:
        """Until the image's HEALTHCHECK (the pod's KVFLOW_HEALTH_URL) passes."""
        end = time.monotonic() + deadline_s
        while True:
            if podman("healthcheck", "run", name, check=False, timeout=60).returncode == 0:
                return
            state = podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout
            if state.strip() not in ("running", "created", "configured"):
                raise AssertionError(f"{name} is {state.strip()}:\n{self.logs(name)}")
            if time.monotonic() > end:
                raise AssertionError(f"{name} not healthy in {deadline_s}s:\n{self.logs(name)}")
            time.sleep(2.0)

    def logs(self, name: str, tail: int = 40) -> str:
        out = podman("logs", "--tail", str(tail), name, check=False)
        return out.stdout + out.stderr

    def client(
        self, argv: Sequence[str], entrypoint: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A one-off container of the image in the pod (a client beside the cluster)."""
        flags = ["--entrypoint", entrypoint] if entrypoint else []
        return podman(
            "run",
            "--rm",
            "--pod",
            self.name,
            "-v",
            f"{self.root / 'hosts'}:/etc/hosts:ro",
            *self._security_flags(),
            *flags,
            IMAGE,
            *argv,
            check=False,
            timeout=300,
        )

    def close(self) -> None:
        podman("pod", "rm", "-f", "--ignore", "-t", "10", self.name, check=False, timeout=300)
        subprocess.run(["rm", "-rf", str(self.root)], check=False)
