"""Where Docker is: a Compose v2 CLI and a Docker engine that answers.

Tests marked ``docker`` (pyproject's markers) run only where both are there
and are skipped elsewhere with the reason (tests/conftest.py); `config`-only
checks need just the CLI (`compose_cmd`)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess


@functools.cache
def compose_cmd() -> tuple[str, ...] | None:
    """A Docker Compose v2 CLI: $FERRY_COMPOSE_BIN, `docker compose` (the CLI
    plugin) or a standalone `docker-compose` v2 (v1, Debian bookworm's
    docker-compose package, does not count)."""
    candidates = []
    if os.environ.get("FERRY_COMPOSE_BIN"):
        candidates.append((os.environ["FERRY_COMPOSE_BIN"],))
    if shutil.which("docker"):
        candidates.append(("docker", "compose"))
    if shutil.which("docker-compose"):
        candidates.append(("docker-compose",))
    for cmd in candidates:
        try:
            r = subprocess.run([*cmd, "version"], check=False, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and re.search(r"version v?2\.", r.stdout):
            return cmd
    return None


@functools.cache
def docker_unavailable() -> str | None:
    """None where a Docker engine answers and a Compose v2 CLI is installed,
    else why not (the skip reason of the ``docker`` marker)."""
    if shutil.which("docker") is None:
        return "no docker CLI (apt-get install docker.io; see deploy/compose/README.md)"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False,
                           capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "the Docker engine does not answer (docker info timed out)"
    if r.returncode != 0 or not r.stdout.strip():
        return f"no Docker engine answers (is dockerd running?): {r.stderr.strip()[:200]}"
    if compose_cmd() is None:
        return "no Docker Compose v2 CLI (docker compose; or FERRY_COMPOSE_BIN, a docker-compose v2 binary)"
    return None
