"""deploy/podman/build_image.py: what of this host's pip configuration goes into the build."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from tests.deploy.manifests import ROOT


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "build_image", ROOT / "deploy" / "podman" / "build_image.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_local_paths_mount_an_index_with_its_files(tmp_path: Path) -> None:
    (tmp_path / "pypi" / "simple").mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    cert = tmp_path / "ca.crt"
    cert.write_text("x")
    settings = {
        "extra-index-url": f"file://{tmp_path}/pypi/simple https://mirror.example/simple",
        "find-links": str(tmp_path / "wheels"),
        "cert": str(cert),
        "index-url": "file:///no/such/simple",
    }
    # an index page links to ../../files/...: the folder above simple/ is mounted
    assert _module().local_paths(settings) == [
        str(tmp_path / "pypi"),
        str(tmp_path / "wheels"),
        str(cert),
    ]


def test_build_command_passes_the_pip_config_and_mounts(tmp_path: Path) -> None:
    cmd = _module().build_command("base:1", "kvflow:t", "", tmp_path, ["/opt/wheels"])
    assert cmd[:3] == ["podman", "build", "--format"]  # docker format keeps HEALTHCHECK
    assert f"{tmp_path}:/run/kvflow-pip:ro" in cmd
    assert "/opt/wheels:/opt/wheels:ro" in cmd
    assert "PIP_CONFIG_FILE=/run/kvflow-pip/pip.conf" in cmd
    assert "BASE_IMAGE=base:1" in cmd and "TORCH_INDEX_URL=" in cmd
    assert cmd[-1] == str(ROOT)
