"""The Kubernetes manifests under deploy/kubernetes, read as Kubernetes would read them.

``render(overlay)`` runs ``kubectl kustomize``; ``pod_env`` and ``pod_argv`` give a container's
environment and command line the way the kubelet builds them for one pod (fieldRef and
configMapKeyRef values, ``$(VAR)`` expanded against the variables defined before), so the
tests parse exactly what a pod would run, and the podman run starts exactly that.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBERNETES_DIR / "overlays").iterdir() if p.is_dir())
# The image's entrypoint after tini (deploy/Containerfile: ENTRYPOINT tini -- kvflow).
ENTRYPOINT = ["kvflow"]
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(overlay: str) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of ``overlay`` (a name under overlays/, or "base"), as objects."""
    path = KUBERNETES_DIR / ("base" if overlay == "base" else f"overlays/{overlay}")
    exe = kubectl()
    if exe is None:
        raise FileNotFoundError("kubectl is not installed")
    out = subprocess.run(
        [exe, "kustomize", str(path)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are replaced, ``$$`` is ``$``,
    anything else is left as written."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR.sub(sub, text)


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("StatefulSet", "Deployment")]


@dataclass(frozen=True)
class Pod:
    """One pod of a workload as the tests and the podman run picture it."""

    workload: dict[str, Any]
    name: str
    namespace: str
    ip: str

    @property
    def spec(self) -> dict[str, Any]:
        return self.workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]

    @property
    def component(self) -> str:
        labels = self.workload["spec"]["template"]["metadata"]["labels"]
        return str(labels["app.kubernetes.io/component"])


def pods(workload: dict[str, Any], namespace: str, ips: dict[str, str] | None = None) -> list[Pod]:
    """The pods of ``workload`` at its replica count: StatefulSet pods are NAME-0..N-1, a
    Deployment's get NAME-<ordinal> (their real names are random; nothing depends on them)."""
    name = workload["metadata"]["name"]
    count = int(workload["spec"].get("replicas", 1))
    names = [f"{name}-{i}" for i in range(count)]
    return [Pod(workload, n, namespace, (ips or {}).get(n, "10.0.0.1")) for n in names]


def pod_env(
    pod: Pod, container: dict[str, Any], configmaps: dict[str, dict[str, Any]]
) -> dict[str, str]:
    """The container's environment variables as the kubelet sets them for ``pod``."""
    fields = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "status.podIP": pod.ip,
    }
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = str(configmaps[ref["name"]]["data"][ref["key"]])
        else:
            raise AssertionError(f"{pod.name}: env {var['name']}: unsupported source {source}")
    return env


def pod_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """What the container runs after tini: ``command`` (replacing the entrypoint) or the
    image's entrypoint, then ``args``, each ``$(VAR)`` expanded."""
    head = container.get("command") or ENTRYPOINT
    return [expand(str(a), env) for a in [*head, *container.get("args", [])]]


def volume_mounts(pod: Pod, container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume (or volumeClaimTemplate, as {'pvc': template}) mounted there."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    for template in pod.workload["spec"].get("volumeClaimTemplates", []):
        volumes[template["metadata"]["name"]] = {"pvc": template}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "": 1}


def quantity_bytes(value: str) -> int:
    """A Kubernetes memory or storage quantity with a binary suffix (or none) in bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|)", str(value))
    if match is None:
        raise ValueError(f"unsupported quantity {value!r} (use Ki, Mi, Gi or Ti)")
    return int(match.group(1)) * _UNITS[match.group(2)]
