"""The policy registry (libs/common/policies): one Policy object per name,
read by every service and tool that lists or runs policies; the
high-priority headroom derived from a step-time profile."""

import click
import pytest

from libs.common import policies
from libs.common.policies.headroom import ideal_speed_headroom, profile_headroom
from libs.common.types import Priority
from services.instance.engine.sim import SimProfile
from services.instance.status import high_priority_headroom


def test_registry_keeps_the_cli_names_in_order():
    assert policies.POLICY_NAMES == ("round_robin", "infaas++", "llumnix_base", "llumnix", "llumnix-v0",
                                     "llumnix-prefix", "llmd-prefix", "dynamo-kv", "sglang-cache-aware", "continuum",
                                     "llumnix-keep", "llumnix-move")
    assert all(policies.get(n).name == n for n in policies.POLICY_NAMES)
    with pytest.raises(ValueError, match="supported: round_robin"):
        policies.get("best")


def test_each_policy_says_how_it_dispatches_migrates_and_uses_priorities():
    rr, inf, base, full = (policies.get(n) for n in policies.POLICY_NAMES[:4])
    assert rr.score is None and not rr.migrates
    assert inf.score is not None and not inf.migrates and not inf.uses_priorities
    assert base.migrates and not base.uses_priorities and base.migration_freeness is not None
    assert full.migrates and full.uses_priorities and full.migration_freeness is not None
    for p in (base, full):
        assert p.migrate_out_threshold < p.migrate_in_threshold
    v0 = policies.get("llumnix-v0")  # Llumnix's first release: one threshold for both
    assert v0.migrates and not v0.uses_priorities and v0.migrate_out_threshold == v0.migrate_in_threshold
    assert not any(policies.get(n).uses_prefix for n in policies.POLICY_NAMES[:5])  # the prefix-blind ones
    for n in policies.POLICY_NAMES[5:]:
        p = policies.get(n)
        assert p.uses_prefix and p.select is not None
        ours = n in ("llumnix-prefix", "continuum", "llumnix-keep", "llumnix-move")  # llumnix-prefix's dispatch and migration
        assert p.migrates == ours and p.uses_priorities == ours
        assert (p.program_ttl_s > 0) == (n == "continuum")  # its TTL pinning is the engines'
        assert (0 < p.program_keep <= 1) == (n in ("llumnix-keep", "llumnix-move"))  # so is keep, within a fraction of the pool


def test_every_reader_lists_the_registry():
    from ferry.bench.serving import POLICIES
    from ferry.up import up
    from services.scheduler.service import SchedulerConfig

    assert POLICIES == policies.POLICY_NAMES
    dispatch = next(p for p in up.params if p.name == "dispatch")
    assert isinstance(dispatch.type, click.Choice) and tuple(dispatch.type.choices) == policies.POLICY_NAMES
    cfg = SchedulerConfig(dispatch="llumnix_base")
    assert cfg.policy is policies.get("llumnix_base")
    assert (cfg.out_threshold, cfg.in_threshold) == (10.0, 20.0)  # the policy's
    assert SchedulerConfig(dispatch="llumnix", migrate_in_threshold=30.0).in_threshold == 30.0  # the flag's


def test_policy_code_does_not_reach_into_services():
    import pathlib

    root = pathlib.Path(policies.__file__).parent
    for f in [*root.glob("*.py"), root.parent / "cluster_view.py"]:
        assert "services." not in f.read_text(), f


def test_headroom_keeps_the_others_under_the_ideal_speed_budget():
    # llama-7b-a10: ideal step 24.2 ms; the others may add 10% = 2.42 ms, at
    # 0.2/512 + 0.00087 ms per token of theirs: 1,919 tokens = 119 blocks.
    p = SimProfile.load("llama-7b-a10")
    assert ideal_speed_headroom(851, 16, 24.0, 0.2, 0.00087) == 851 - 119
    assert profile_headroom(p) == 851 - 119
    assert profile_headroom(p, num_blocks=100) == 0  # a small cache: all of it
    assert profile_headroom(None) == 0  # engines without a profile
    assert ideal_speed_headroom(851, 16, 24.0, 0.0, 0.0) == 0  # free co-runners: nothing to reserve


def test_the_flag_only_overrides_the_derived_headroom():
    p = SimProfile.load("llama-7b-a10")
    assert high_priority_headroom(None, p) == {Priority.HIGH: 732}
    assert high_priority_headroom(100, p) == {Priority.HIGH: 100}
    assert high_priority_headroom(0, p) == {Priority.HIGH: 0}
    assert high_priority_headroom(None, None) == {Priority.HIGH: 0}
