"""What ``ferry up`` leaves beside a running cluster for the tools that watch
it: a Prometheus file-based service-discovery file listing every process's
/metrics (deploy/prometheus/prometheus.yml reads it), and a cluster file
(the frontend's URL, the scheduler's and meta store's addresses, the cluster
token in a file of its own, readable by its owner only) that ``ferry top``
reads, and a Prometheus configuration that scrapes those targets and
evaluates Ferry's alerting rules. Both live in ``$FERRY_CACHE_DIR/up-<port>/`` and are removed when the
cluster stops."""

from __future__ import annotations

import json
import os
import pathlib

from ferry.cluster import LocalCluster
from libs.common.models import cache_root

# The ``job`` of each kind of process: the names dashboards and alert rules select on.
JOBS = {"frontend": "ferry-frontend", "scheduler": "ferry-scheduler", "instance": "ferry-instance",
        "meta-store": "ferry-meta-store"}


def state_dir(port: int) -> pathlib.Path:
    """Where ``ferry up`` on HTTP port ``port`` keeps these files."""
    return cache_root() / f"up-{port}"


def sd_groups(cluster: LocalCluster) -> list[dict]:
    """The cluster's scrape targets in Prometheus's file_sd format: one group
    per process, labelled with its job and its name (``ferry_name``: not
    ``instance``, the target's address, nor ``instance_id``, which the
    instances' own series carry)."""
    return [{"targets": [address], "labels": {"job": JOBS[c.kind], "ferry_name": c.name}}
            for c, address in cluster.metrics_targets()]


def _write(path: pathlib.Path, text: str, mode: int = 0o644) -> None:
    """Atomically (Prometheus re-reads a file_sd file whenever it changes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_sd_file(cluster: LocalCluster, path: pathlib.Path) -> pathlib.Path:
    _write(path, json.dumps(sd_groups(cluster), indent=2) + "\n")
    return path


RULES = pathlib.Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "ferry-rules.yml"


def prometheus_config(sd_file: pathlib.Path, interval_s: float = 5.0, rules: pathlib.Path | None = RULES) -> dict:
    """A Prometheus configuration that scrapes the targets of ``sd_file``
    (re-read as it changes) and evaluates Ferry's alerting rules (where this
    checkout has them)."""
    interval = f"{interval_s:g}s"
    cfg = {"global": {"scrape_interval": interval, "evaluation_interval": interval},
           "scrape_configs": [{"job_name": "ferry", "file_sd_configs": [{"files": [str(sd_file)]}]}]}
    if rules is not None and rules.is_file():
        cfg["rule_files"] = [str(rules)]
    return cfg


def write_prometheus_config(path: pathlib.Path, sd_file: pathlib.Path, interval_s: float = 5.0,
                            rules: pathlib.Path | None = RULES) -> pathlib.Path:
    """As JSON, which is YAML too (no YAML writer needed at run time)."""
    _write(path, json.dumps(prometheus_config(sd_file, interval_s, rules), indent=2) + "\n")
    return path


def write_cluster_file(cluster: LocalCluster, directory: pathlib.Path) -> pathlib.Path:
    """``cluster.json`` (addresses) and, with a cluster token, ``token`` (0600)."""
    token = ""
    if cluster.spec.cluster_token:
        token_path = directory / "token"
        _write(token_path, cluster.spec.cluster_token + "\n", mode=0o600)
        token = str(token_path)
    info = {"url": cluster.url, "scheduler": cluster.scheduler, "meta_store": cluster.meta_store,
            "token_file": token, "metrics": {c.name: f"http://{a}/metrics" for c, a in cluster.metrics_targets()}}
    path = directory / "cluster.json"
    _write(path, json.dumps(info, indent=2) + "\n")
    return path


def read_cluster_file(port: int) -> dict:
    """What ``ferry up`` on ``port`` wrote (FileNotFoundError: none is running there)."""
    return json.loads((state_dir(port) / "cluster.json").read_text())


def remove(directory: pathlib.Path) -> None:
    for name in ("cluster.json", "token", "targets.json", "prometheus.yml"):
        try:
            (directory / name).unlink()
        except FileNotFoundError:
            pass
