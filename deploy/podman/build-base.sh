#!/bin/sh
# Builds a Debian bookworm base image from Debian's packages (no container registry needed):
# mmdebstrap's minbase variant with Python 3.11, venv and tini, imported into podman.
#   deploy/podman/build-base.sh [TAG]      (default localhost/kvflow-base:bookworm)
# The Containerfile then builds FROM it: --build-arg BASE_IMAGE=localhost/kvflow-base:bookworm
set -eu
tag="${1:-localhost/kvflow-base:bookworm}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
mmdebstrap --variant=minbase --include=python3,python3-venv,tini,ca-certificates \
    --aptopt='APT::Install-Recommends "false"' bookworm "$out/rootfs.tar"
podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    "$out/rootfs.tar" "$tag"
echo "built $tag"
