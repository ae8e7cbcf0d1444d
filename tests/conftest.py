from __future__ import annotations

import pytest

from ferry.cluster import ClusterSpec, LocalCluster, free_port


def start_fake_cluster(tmp_path_factory, name: str, instances: int = 2, **kw) -> LocalCluster:
    spec = ClusterSpec(instances=instances, engine="fake", port=free_port(),
                       log_dir=str(tmp_path_factory.mktemp(name)), **kw)
    cluster = LocalCluster(spec)
    cluster.start(timeout_s=60)
    return cluster


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory):
    """Two fake-engine instances behind the real frontend, scheduler and meta store."""
    cluster = start_fake_cluster(tmp_path_factory, "fake-cluster",
                                 instance_args=["--token-delay-ms", "5", "--num-blocks", "4096"])
    yield cluster
    cluster.stop()
