"""deploy/kubernetes: every overlay renders (kubectl kustomize), every object validates offline
against Kubernetes' schemas with unknown fields refused (kubernetes-validate --strict), and
every container's command is one kvflow accepts, listening where its probes, Services and
scrape annotations look, in a Raft group whose peers are the StatefulSet's DNS names."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvflow.pipeline.health import LIVENESS_PATH, READINESS_PATH
from kvflow.tools.cli import build_parser
from tests.deploy.manifests import (
    OVERLAYS,
    Pod,
    by_kind,
    kubectl,
    pod_argv,
    pod_env,
    pods,
    quantity_bytes,
    render,
    volume_mounts,
    workloads,
)

pytestmark = pytest.mark.skipif(
    kubectl() is None, reason="kubectl is not installed (it renders the kustomize overlays)"
)
NAMESPACE = "kvflow-test"
ROLES = {"meta": "meta", "prefill": "node", "decode": "node", "router": "router"}
ALL = ["base", *OVERLAYS]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(name) for name in ALL}


def test_the_overlays_are_there() -> None:
    assert {"small", "large"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", ALL)
def test_renders_every_role(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objs = rendered[overlay]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for name in ("kvflow-meta", "kvflow-prefill", "kvflow-decode"):
        assert ("StatefulSet", name) in kinds
        assert ("Service", name) in kinds
    assert ("Deployment", "kvflow-router") in kinds
    assert ("Service", "kvflow-router") in kinds
    assert ("PodDisruptionBudget", "kvflow-meta") in kinds
    assert ("ConfigMap", "kvflow-config") in kinds


@pytest.mark.parametrize(
    ("overlay", "replicas"),
    [
        ("small", {"kvflow-meta": 3, "kvflow-prefill": 2, "kvflow-decode": 1, "kvflow-router": 2}),
        ("large", {"kvflow-meta": 5, "kvflow-prefill": 64, "kvflow-decode": 32}),
    ],
)
def test_overlay_sizes(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, replicas: dict[str, int]
) -> None:
    counts = {w["metadata"]["name"]: w["spec"]["replicas"] for w in workloads(rendered[overlay])}
    assert {k: counts[k] for k in replicas} == replicas


@pytest.mark.parametrize("overlay", ALL)
def test_every_object_validates_strictly_offline(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    try:
        for obj in rendered[overlay]:
            kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {exc}")
    except (
        kubernetes_validate.SchemaNotFoundError,
        kubernetes_validate.VersionNotSupportedError,
    ) as exc:
        pytest.skip(f"kubernetes-validate's schemas did not load offline: {exc}")


def test_strict_validation_refuses_an_unknown_field(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    router = by_kind(rendered["small"], "Deployment")["kvflow-router"]
    router["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router, kubernetes_validate.latest_version(), strict=True)


# -- the commands, as each pod runs them ---------------------------------------------------------
def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser("serve")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]  # type: ignore[no-any-return]


def _parse(argv: list[str]) -> argparse.Namespace:
    """kvflow's own parser on a container's command line; every --flag must be one that
    exists as written (argparse would otherwise accept an abbreviation)."""
    assert argv[0] == "kvflow", argv
    parser = build_parser("serve")
    known = set(parser._option_string_actions) | set(_serve_parser()._option_string_actions)
    for word in argv[1:]:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in known, f"kvflow serve has no flag {flag}"
    try:
        return parser.parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"kvflow refused {argv}") from exc


def _cases(rendered: dict[str, list[dict[str, Any]]]) -> list[tuple[str, Pod, dict[str, Any]]]:
    out = []
    for overlay in ALL:
        configmaps = by_kind(rendered[overlay], "ConfigMap")
        for workload in workloads(rendered[overlay]):
            for pod in pods(workload, NAMESPACE):
                container = pod.spec["containers"][0]
                out.append(
                    (overlay, pod, {"env": pod_env(pod, container, configmaps), "c": container})
                )
    return out


def _domain(objs: list[dict[str, Any]]) -> str:
    return str(by_kind(objs, "ConfigMap")["kvflow-config"]["data"]["CLUSTER_DOMAIN"])


def _stable_name(workload: dict[str, Any], ordinal: int, domain: str) -> str:
    name, service = workload["metadata"]["name"], workload["spec"]["serviceName"]
    return f"{name}-{ordinal}.{service}.{NAMESPACE}.svc.{domain}"


def _listens(args: argparse.Namespace) -> set[int]:
    """The ports a role's process listens on, from its parsed flags."""
    if args.role == "meta":
        return {int(args.address.rsplit(":", 1)[1]), args.grpc_port, args.metrics_port}
    if args.role == "node":
        return {args.port, args.transfer_port, args.metrics_port}
    assert args.role == "router"
    return {args.port, args.http_port, args.metrics_port}


def test_every_command_parses_with_kvflows_parser(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, pod, case in _cases(rendered):
        args = _parse(pod_argv(case["c"], case["env"]))
        assert args.command == "serve", (overlay, pod.name)
        assert args.role == ROLES[pod.component], (overlay, pod.name)
        assert "$(" not in " ".join(pod_argv(case["c"], case["env"])), (overlay, pod.name)


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"no container port named {port}"
    return int(named[port])


def test_probes_services_and_scrapes_name_ports_the_role_listens_on(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, pod, case in _cases(rendered):
        c = case["c"]
        args = _parse(pod_argv(c, case["env"]))
        listens = _listens(args)
        where = f"{overlay} {pod.name}"
        assert {p["containerPort"] for p in c["ports"]} == listens, where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe not in c:
                continue
            action = c[probe].get("httpGet") or c[probe].get("tcpSocket")
            assert action is not None, f"{where}: {probe} is neither httpGet nor tcpSocket"
            assert _port_number(c, action["port"]) in listens, f"{where}: {probe}"
        for required in ("readinessProbe", "livenessProbe"):
            assert required in c, f"{where}: no {required}"
        notes = pod.workload["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true", where
        assert int(notes["prometheus.io/port"]) == args.metrics_port, where
        labels = pod.workload["spec"]["template"]["metadata"]["labels"]
        for service in by_kind(rendered[overlay], "Service").values():
            selector = service["spec"].get("selector", {})
            if selector and all(labels.get(k) == v for k, v in selector.items()):
                for port in service["spec"]["ports"]:
                    target = _port_number(c, port.get("targetPort", port["port"]))
                    assert target in listens, f"{where}: Service {service['metadata']['name']}"


PROBE_PATHS = {
    "startupProbe": LIVENESS_PATH,
    "livenessProbe": LIVENESS_PATH,
    "readinessProbe": READINESS_PATH,
}


def test_probes_are_the_health_endpoints_on_the_metrics_port(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Every role's probes GET the paths kvflow's metrics server answers (pipeline/health.py)
    on the port the role serves its metrics on; so does the image's HEALTHCHECK URL."""
    for overlay, pod, case in _cases(rendered):
        c = case["c"]
        args = _parse(pod_argv(c, case["env"]))
        where = f"{overlay} {pod.name}"
        for probe, path in PROBE_PATHS.items():
            if probe not in c:
                continue
            action = c[probe].get("httpGet")
            assert action is not None, f"{where}: {probe} is not an httpGet"
            assert action["path"] == path, f"{where}: {probe}"
            assert _port_number(c, action["port"]) == args.metrics_port, f"{where}: {probe}"
        url = urlsplit(case["env"]["KVFLOW_HEALTH_URL"])
        assert (url.port, url.path) == (args.metrics_port, READINESS_PATH), where
        if args.role == "router":
            assert args.drain_s + 3 <= pod.spec["terminationGracePeriodSeconds"], where
    for overlay in ALL:
        service = by_kind(rendered[overlay], "Service")["kvflow-router"]
        assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc"}, overlay


def test_raft_peers_are_the_statefulsets_dns_names(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay in ALL:
        objs = rendered[overlay]
        domain = _domain(objs)
        meta = by_kind(objs, "StatefulSet")["kvflow-meta"]
        service = by_kind(objs, "Service")[meta["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None", overlay  # headless: per-pod DNS names
        assert service["spec"]["publishNotReadyAddresses"] is True, overlay
        n = meta["spec"]["replicas"]
        names = [_stable_name(meta, i, domain) for i in range(n)]
        configmaps = by_kind(objs, "ConfigMap")
        grpc_ports = set()
        for i, pod in enumerate(pods(meta, NAMESPACE)):
            c = pod.spec["containers"][0]
            args = _parse(pod_argv(c, pod_env(pod, c, configmaps)))
            raft_port = int(args.address.rsplit(":", 1)[1])
            assert args.address == f"{names[i]}:{raft_port}", overlay
            assert args.host == names[i], overlay
            assert args.meta_id == pod.name, overlay
            peers = args.peers.split(",")
            assert peers == [f"{name}:{raft_port}" for name in names], (overlay, pod.name)
            grpc_ports.add(args.grpc_port)
        (grpc_port,) = grpc_ports
        endpoints = ",".join(f"{name}:{grpc_port}" for name in names)
        for workload in workloads(objs):
            if workload is meta:
                continue
            for pod in pods(workload, NAMESPACE):
                c = pod.spec["containers"][0]
                args = _parse(pod_argv(c, pod_env(pod, c, configmaps)))
                assert args.meta == endpoints, (overlay, pod.name)


def test_nodes_register_under_their_stable_names(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay in ALL:
        objs = rendered[overlay]
        configmaps = by_kind(objs, "ConfigMap")
        for name in ("kvflow-prefill", "kvflow-decode"):
            sts = by_kind(objs, "StatefulSet")[name]
            assert (
                by_kind(objs, "Service")[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
            )
            for i, pod in enumerate(pods(sts, NAMESPACE)):
                c = pod.spec["containers"][0]
                args = _parse(pod_argv(c, pod_env(pod, c, configmaps)))
                assert args.host == _stable_name(sts, i, _domain(objs)), overlay
                assert args.node_id == pod.name, overlay
                assert args.kind == name.removeprefix("kvflow-"), overlay


def test_node_memory_shm_and_volume_match_the_tiers(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay in ALL:
        objs = rendered[overlay]
        configmaps = by_kind(objs, "ConfigMap")
        for name in ("kvflow-prefill", "kvflow-decode"):
            pod = pods(by_kind(objs, "StatefulSet")[name], NAMESPACE)[0]
            c = pod.spec["containers"][0]
            args = _parse(pod_argv(c, pod_env(pod, c, configmaps)))
            dram, ssd = args.dram_mb << 20, args.ssd_mb << 20
            mem = c["resources"]
            assert mem["requests"]["memory"] == mem["limits"]["memory"], (overlay, name)
            assert quantity_bytes(mem["limits"]["memory"]) >= dram + (1 << 30), (overlay, name)
            mounts = volume_mounts(pod, c)
            assert quantity_bytes(mounts["/dev/shm"]["emptyDir"]["sizeLimit"]) == dram
            assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
            data = mounts[str(args.data_dir)]["pvc"]["spec"]["resources"]["requests"]["storage"]
            assert quantity_bytes(data) >= ssd, (overlay, name)


def test_meta_journal_is_on_a_volume_claim(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in ALL:
        objs = rendered[overlay]
        pod = pods(by_kind(objs, "StatefulSet")["kvflow-meta"], NAMESPACE)[0]
        c = pod.spec["containers"][0]
        args = _parse(pod_argv(c, pod_env(pod, c, by_kind(objs, "ConfigMap"))))
        assert not args.memory_journal
        assert "pvc" in volume_mounts(pod, c)[str(args.data_dir)], overlay


def _secret_volume(pod: Pod, path: str) -> str:
    """The Secret behind the file ``path`` in ``pod``: mounted directly, or copied by an init
    container (``install SRC DST``) from a Secret mount."""
    for init in pod.spec.get("initContainers", []):
        command = init.get("command", [])
        if command[:1] == ["install"] and command[-1] == path:
            return _secret_volume_of(pod, init, command[-2])
    return _secret_volume_of(pod, pod.spec["containers"][0], path)


def _secret_volume_of(pod: Pod, container: dict[str, Any], path: str) -> str:
    for mount_path, volume in volume_mounts(pod, container).items():
        if path.startswith(mount_path.rstrip("/") + "/") and "secret" in volume:
            return str(volume["secret"]["secretName"])
    raise AssertionError(f"{pod.name}: {path} is not on a Secret volume")


def test_secrets_come_from_secrets_and_every_container_is_locked_down(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, pod, case in _cases(rendered):
        args = _parse(pod_argv(case["c"], case["env"]))
        where = f"{overlay} {pod.name}"
        assert _secret_volume(pod, str(args.cluster_secret_file)) == "kvflow-cluster-secret", where
        if args.role == "router":
            assert _secret_volume(pod, str(args.api_key_file)) == "kvflow-api-keys", where
        security = pod.spec["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, where
        for c in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "limits" in c["resources"], where
        if args.role != "meta":
            assert pod.spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"], where
