"""Pinning instances to cores: --cpus parsing, the split `ferry up --pin-cores`
makes, and the affinity a pinned process gets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ferry.cluster import ClusterSpec, LocalCluster
from ferry.serve_cli import serve
from libs.common.config import ConfigError
from libs.common.cpus import available_cores, cores_for, parse_cpus
from services.instance.config import InstanceConfig


def test_parse_cpus_takes_ids_and_ranges():
    assert parse_cpus("0") == [0]
    assert parse_cpus("3-5,0, 4") == [0, 3, 4, 5]


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "-1", "0,,1"])
def test_parse_cpus_says_what_is_wrong(text):
    with pytest.raises(ValueError, match="cpus"):
        parse_cpus(text)


def test_cores_are_split_into_disjoint_shares():
    cores = [0, 1, 2, 3, 4, 5, 6, 7]
    shares = [cores_for(i, 3, cores) for i in range(3)]
    assert shares == [[0, 1], [2, 3], [4, 5]]
    assert cores_for(0, 2, [0, 1]) == [0] and cores_for(1, 2, [0, 1]) == [1]
    # more instances than cores: one core each, shared round robin
    assert [cores_for(i, 3, [0, 1]) for i in range(3)] == [[0], [1], [0]]
    # an instance past the cluster's count shares an earlier one's cores, never none
    assert cores_for(5, 2, [0, 1, 2, 3]) == [2, 3]


def test_pinned_cluster_gives_each_instance_its_share_unless_told():
    spec = ClusterSpec(instances=2, engine="fake", pin_cores=True)
    cluster = LocalCluster(spec)
    args = [cluster.instance_child().args for _ in range(2)]
    cpus = [a[a.index("--cpus") + 1] for a in args]
    assert cpus == [",".join(map(str, cores_for(i, 2, available_cores()))) for i in range(2)]
    assert "--cpus" not in LocalCluster(ClusterSpec(engine="fake")).instance_child().args
    told = LocalCluster(ClusterSpec(engine="fake", pin_cores=True, instance_args=["--cpus=0"])).instance_child().args
    assert told.count("--cpus") == 0 and "--cpus=0" in told


def test_bad_cpus_are_a_config_error():
    with pytest.raises(ConfigError, match="cpus"):
        InstanceConfig(cpus="0-x")
    assert InstanceConfig(cpus="0").cpus == "0"


def test_serve_instance_refuses_bad_or_unavailable_cpus():
    bad = CliRunner().invoke(serve, ["instance", "--engine", "fake", "--cpus", "x"])
    assert bad.exit_code == 2 and "cpus" in bad.output
    missing = CliRunner().invoke(serve, ["instance", "--engine", "fake", "--cpus", "100000"])
    assert missing.exit_code == 2 and "not available" in missing.output


def test_pin_sets_the_affinity_that_threads_started_later_inherit():
    core = available_cores()[-1]
    code = ("import os, threading; from libs.common.cpus import pin; pin(%r); seen = []; "
            "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join(); "
            "print(sorted(os.sched_getaffinity(0)), seen[0])") % str(core)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.split() == [f"[{core}]", f"[{core}]"]
