from __future__ import annotations

import pytest

from ferry.cluster import ClusterSpec, LocalCluster, free_port


def pytest_collection_modifyitems(config, items):
    """Tests marked ``docker`` run only where a Docker engine answers and a
    Compose v2 CLI is installed; elsewhere they are skipped with the reason."""
    marked = [item for item in items if item.get_closest_marker("docker")]
    if not marked:
        return
    from tests.docker_env import docker_unavailable

    reason = docker_unavailable()
    if reason:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


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
