#!/bin/sh
# Builds a Debian base image for deploy/docker/Dockerfile.cpu from Debian's
# own packages, with no image registry: debootstrap a minimal bookworm root
# (with Python 3.11 and its venv module) and `docker import` it.
#
#   sudo deploy/docker/base.sh                       # -> ferry-base:bookworm
#   sudo deploy/docker/base.sh my-base:tag           # another tag
#   docker build -f deploy/docker/Dockerfile.cpu \
#       --build-arg PYTHON_IMAGE=ferry-base:bookworm -t ferry:cpu .
#
# For hosts that cannot pull python:3.11-slim-bookworm (no registry, or an
# air-gapped one) but reach a Debian mirror. Needs root, debootstrap and a
# running Docker engine. Settings (environment):
#   FERRY_BASE_SUITE   Debian suite (bookworm: Python 3.11, which Ferry needs at least)
#   FERRY_BASE_MIRROR  Debian mirror (http://deb.debian.org/debian)
set -eu

tag="${1:-ferry-base:bookworm}"
suite="${FERRY_BASE_SUITE:-bookworm}"
mirror="${FERRY_BASE_MIRROR:-http://deb.debian.org/debian}"

command -v debootstrap >/dev/null || { echo "base.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "base.sh: no Docker engine answers (is dockerd running?)" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT INT TERM
root="$work/root"

# minbase: essential and apt only. python3-venv brings ensurepip (the images
# make a venv); ca-certificates gives update-ca-certificates, with which the
# build adds a proxy's CA (deploy/docker/ca/).
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$suite" "$root" "$mirror"

# What an image does not need: downloaded packages and package lists.
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root"/tmp/*

tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $suite $mirror" \
    - "$tag"
echo "base.sh: built $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes)"
