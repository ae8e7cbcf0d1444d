"""The scheduler's dispatch index makes the same choice as the policy's
Dispatcher over the same views (libs/common/policies/index.py), on random
clusters, requests, exclusions, updates and removals."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.common.policies import Dispatcher, DispatchRequest, InstanceView, get
from libs.common.policies.index import DispatchIndex
from libs.common.types import InstanceStatus, Role

POLICIES = ["llumnix", "llumnix_base"]


def random_view(rng: random.Random, iid: str) -> InstanceView:
    total = rng.choice([64, 512, 4096])
    running = rng.randint(0, 40)
    free = rng.randint(0, total)
    st_ = InstanceStatus(
        instance_id=iid, total_blocks=total, free_blocks=free, block_size=rng.choice([16, 16, 32]),
        num_running=running, num_waiting=rng.choice([0, 0, rng.randint(1, 9)]),
        head_of_line_demand_blocks=rng.choice([0, rng.randint(1, 200)]),
        waiting_demand_blocks=rng.choice([0, rng.randint(1, 400)]),
        freeness=rng.choice([rng.uniform(-300, 300), float(free) / max(1, running), 0.0]),
        terminating=rng.random() < 0.1)
    return InstanceView(iid, st_, rng.choice([0, rng.randint(0, 300)]), rng.choice([0, rng.randint(0, 6)]))


def check(policy: str, views: list[InstanceView], index: DispatchIndex, rng: random.Random) -> None:
    d = Dispatcher(get(policy))
    ids = [v.instance_id for v in views]
    for _ in range(20):
        exclude = frozenset(rng.sample(ids, rng.randint(0, min(3, len(ids))))) if ids else frozenset()
        req = DispatchRequest("r", rng.choice([1, 15, 16, 17, 100, 1000, 20000]), exclude=exclude)
        assert index.choose(req) == d.choose(views, req), (req, views)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 40))
def test_the_index_chooses_as_the_dispatcher(policy, seed, n):
    rng = random.Random(seed)
    ids = rng.sample(range(1000), n)
    views = {f"i-{k}": random_view(rng, f"i-{k}") for k in ids}
    index = DispatchIndex(get(policy))
    for iid, v in views.items():
        index.update(iid, v)
    check(policy, list(views.values()), index, rng)
    # Changes, arrivals and departures, row by row.
    for _ in range(30):
        op = rng.random()
        if op < 0.2 and views:
            gone = rng.choice(sorted(views))
            del views[gone]
            index.update(gone, None)
        else:
            iid = f"i-{rng.randrange(1000)}"
            views[iid] = random_view(rng, iid)
            index.update(iid, views[iid])
    assert index.ids == sorted(views)
    check(policy, list(views.values()), index, rng)


def test_the_index_counts_instances_that_are_not_mixed():
    index = DispatchIndex(get("llumnix"))
    rng = random.Random(0)
    v = random_view(rng, "a")
    index.update("a", v)
    assert index.split == 0
    index.update("a", InstanceView("a", InstanceStatus(instance_id="a", role=Role.PREFILL, total_blocks=8)))
    assert index.split == 1
    index.update("b", v)
    index.update("a", None)
    assert index.split == 0 and index.ids == ["b"]


def test_policies_without_terms_have_no_index():
    with pytest.raises(ValueError):
        DispatchIndex(get("round_robin"))
