"""A cluster's instances get what its dispatch policy needs of their engines
(ferry/cluster.py ``policy_instance_args``): llumnix-keep's and llumnix-move's
keep budget, continuum's TTL, unless the instance arguments set them; the
scheduler's launch template (auto-scaled instances) too."""

from __future__ import annotations

from ferry.cluster import ClusterSpec, LocalCluster
from libs.common.policies import get


def args(**kw) -> list[str]:
    return LocalCluster(ClusterSpec(engine="fake", **kw)).instance_child().args


def test_a_policy_that_keeps_programs_blocks_sets_the_instances_budget():
    for name in ("llumnix-keep", "llumnix-move"):
        a = args(dispatch=name)
        assert a[a.index("--program-keep") + 1] == f"{get(name).program_keep:g}"
    a = args(dispatch="continuum")
    assert a[a.index("--program-ttl-s") + 1] == f"{get('continuum').program_ttl_s:g}"
    assert "--program-keep" not in args(dispatch="llumnix") and "--program-ttl-s" not in args(dispatch="llumnix")


def test_the_instance_arguments_win_and_the_launch_template_has_it():
    a = args(dispatch="llumnix-keep", instance_args=["--program-keep=0.25"])
    assert "--program-keep" not in a and "--program-keep=0.25" in a
    a = args(dispatch="llumnix-keep", per_instance_args={0: ["--program-keep", "0.1"]})
    assert a.count("--program-keep") == 1 and a[a.index("--program-keep") + 1] == "0.1"
    # another instance's own argument is not this one's
    a = args(dispatch="llumnix-keep", per_instance_args={1: ["--program-keep", "0.1"]})
    assert a[a.index("--program-keep") + 1] == f"{get('llumnix-keep').program_keep:g}"
    launch = LocalCluster(ClusterSpec(engine="fake", dispatch="llumnix-move")).instance_launch_args()
    assert "--program-keep 0.75" in launch
