"""`ferry up` splits the cores between native instances (torch threads)."""

from __future__ import annotations

from ferry.cluster import ClusterSpec, LocalCluster, threads_per_instance


def test_cores_are_split_between_instances():
    assert threads_per_instance(2, cores=2) == 1
    assert threads_per_instance(1, cores=2) == 2
    assert threads_per_instance(3, cores=8) == 2
    assert threads_per_instance(4, cores=2) == 1  # never 0


def test_native_instances_get_torch_threads_unless_given():
    args = LocalCluster(ClusterSpec(instances=2)).instance_child().args
    i = args.index("--torch-threads")
    assert int(args[i + 1]) == threads_per_instance(2)
    given = LocalCluster(ClusterSpec(instance_args=["--torch-threads=2"])).instance_child().args
    assert given.count("--torch-threads") == 0 and "--torch-threads=2" in given
    assert "--torch-threads" not in LocalCluster(ClusterSpec(engine="fake")).instance_child().args
