"""Build kvflow's image with podman, passing this host's pip configuration into the build.

    python3 deploy/podman/build_image.py [--base IMAGE] [--tag TAG] [--torch-index-url URL]

The build's pip gets the settings `pip config list` shows here (index mirrors, find-links, the
CA bundle; not `constraint`, which caps this host's own installs) as a pip.conf mounted at
/run/kvflow-pip/pip.conf, and every local file or folder those settings name is mounted
read-only at its own path. With the default --torch-index-url (empty) torch comes from those
settings too (a local wheel cache); elsewhere pass PyTorch's index. Run from anywhere; the
context is the repository root. Prints the podman command before running it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
PIP_DIR = "/run/kvflow-pip"
# pip settings that carry over into the build (the rest are this host's own business)
KEPT = ("index-url", "extra-index-url", "find-links", "cert", "trusted-host", "timeout")


def host_pip_settings(python: str = sys.executable) -> dict[str, str]:
    """``pip config list`` here: name -> value, the environment's values overriding files'."""
    out = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in out.splitlines():
        key, _, raw = line.partition("=")
        value = raw.strip().strip("'\"")
        scope, _, name = key.rpartition(".")
        if name in KEPT and value:
            (env if scope.startswith(":env:") else files)[name] = value
    return {**files, **env}


def local_paths(settings: dict[str, str]) -> list[str]:
    """The existing local files and folders the settings name (paths, and file:// URLs:
    for an index, the folder above its ``simple``, where its pages' links lead)."""
    found: list[str] = []
    for value in settings.values():
        for word in value.split():
            path = word.removeprefix("file://").rstrip("/")
            if word.startswith("file://") and path.endswith("/simple"):
                path = os.path.dirname(path)
            if path.startswith("/") and os.path.exists(path) and path not in found:
                found.append(path)
    return found


def build_command(
    base: str, tag: str, torch_index_url: str, pip_dir: Path, mounts: list[str]
) -> list[str]:
    cmd = ["podman", "build", "--format", "docker", "--network", "host", "-f", str(CONTAINERFILE)]
    cmd += ["--volume", f"{pip_dir}:{PIP_DIR}:ro"]
    for path in mounts:
        cmd += ["--volume", f"{path}:{path}:ro"]
    cmd += [
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--build-arg",
        f"TORCH_INDEX_URL={torch_index_url}",
    ]
    cmd += ["--build-arg", f"PIP_CONFIG_FILE={PIP_DIR}/pip.conf", "-t", tag, str(ROOT)]
    return cmd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="localhost/kvflow-base:bookworm")
    p.add_argument("--tag", default="localhost/kvflow:dev")
    p.add_argument("--torch-index-url", default="")
    args = p.parse_args(argv)
    settings = host_pip_settings()
    # One folder for every build (under build/, which git and the build context leave out): a
    # mount that moves from build to build would defeat podman's layer cache.
    pip_dir = ROOT / "build" / "podman-pip"
    pip_dir.mkdir(parents=True, exist_ok=True)
    pip_dir.chmod(0o755)
    conf = pip_dir / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    conf.chmod(0o644)
    cmd = build_command(args.base, args.tag, args.torch_index_url, pip_dir, local_paths(settings))
    print("+ " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
