"""KunServe's throttle forecast and buddy-group planner
(libs/common/policies/kunserve.py), the planner against a brute-force search
over every grouping of small clusters."""

import itertools
import math
import random

import pytest

from libs.common.policies.kunserve import (
    BuddyGroup,
    BuddyPlan,
    Candidate,
    Member,
    MemorySample,
    add_sample,
    buddy_group,
    fits_own_memory,
    forecast_instance,
    holders_cover,
    merge_groups,
    plan_buddy_groups,
    predict_throttle,
    sample_of,
)
from libs.common.types import InstanceStatus

# ---------------------------------------------------------------- forecast


def linear(used0: float, rate: float, total: int, times=range(5), queued: int = 0) -> list[MemorySample]:
    return [MemorySample(float(t), round(used0 + rate * t), total, queued) for t in times]


def test_linear_growth_predicts_when_it_throttles():
    f = forecast_instance("a", linear(200, 50, 1000))  # 400 used at t=4, 50/s: full 12 s later
    assert f.rate == pytest.approx(50)
    assert f.time_to_throttle == pytest.approx(12)
    assert not f.throttled and f.deficit_blocks == 0
    late = forecast_instance("a", linear(200, 50, 1000), horizon=12.5)
    assert late.deficit_blocks == 25  # 0.5 s past full at 50/s


def test_growth_about_to_cross_within_the_default_second():
    f = forecast_instance("a", linear(760, 50, 1000))  # 960 at t=4
    assert f.time_to_throttle == pytest.approx(0.8)
    assert f.throttled and f.deficit_blocks == 10


def test_queue_counts_and_admission_is_no_growth():
    growing_queue = [MemorySample(float(t), 500, 1000, 100 * t) for t in range(4)]
    f = forecast_instance("a", growing_queue)
    assert f.rate == pytest.approx(100) and f.time_to_throttle == pytest.approx(2.0)
    # requests move from the queue into the KV cache: the requirement stays 900
    admitted = [MemorySample(float(t), 600 + 100 * t, 1000, 300 - 100 * t) for t in range(4)]
    g = forecast_instance("a", admitted)
    assert g.rate == pytest.approx(0) and not g.throttled and math.isinf(g.time_to_throttle)


def test_flat_and_falling_use_predict_no_throttle():
    flat = forecast_instance("a", linear(900, 0, 1000))
    assert flat.rate == 0 and not flat.throttled and math.isinf(flat.time_to_throttle)
    falling = forecast_instance("a", linear(990, -20, 1000))
    assert falling.rate == pytest.approx(-20) and not falling.throttled and math.isinf(falling.time_to_throttle)


def test_already_over_capacity_stays_throttled_even_while_falling():
    f = forecast_instance("a", linear(1000, -30, 1000, queued=200))  # requirement 1080 at t=4, falling
    assert f.time_to_throttle == 0 and f.deficit_blocks == 80


def test_one_sample_has_no_trend():
    f = forecast_instance("a", [MemorySample(3.0, 990, 1000, 40)])
    assert f.rate == 0 and f.deficit_blocks == 30 and f.time_to_throttle == 0
    assert not forecast_instance("a", [MemorySample(3.0, 500, 1000)]).throttled


def test_least_squares_rate_through_noise():
    rng = random.Random(7)
    samples = [MemorySample(t * 0.1, round(300 + 40 * t * 0.1 + rng.uniform(-5, 5)), 1000) for t in range(30)]
    assert forecast_instance("a", samples).rate == pytest.approx(40, abs=4)


@pytest.mark.parametrize("samples, match", [
    ([], "no memory samples"),
    ([MemorySample(1.0, 10, 100), MemorySample(1.0, 20, 100)], "times must increase"),
    ([MemorySample(2.0, 10, 100), MemorySample(1.0, 20, 100)], "times must increase"),
    ([MemorySample(1.0, -1, 100)], "invalid sample"),
    ([MemorySample(1.0, 1, 100, -5)], "invalid sample"),
    ([MemorySample(math.nan, 1, 100)], "invalid sample"),
])
def test_bad_samples_raise(samples, match):
    with pytest.raises(ValueError, match=match):
        forecast_instance("a", samples)


def test_bad_horizon_raises():
    with pytest.raises(ValueError, match="horizon"):
        forecast_instance("a", linear(0, 1, 10), horizon=0)


def test_cluster_forecast_sums_the_throttled_instances():
    calm = {"a": linear(100, 0, 1000), "b": linear(100, 10, 1000)}
    assert not predict_throttle(calm).throttled and predict_throttle(calm).deficit_blocks == 0
    hot = {"a": linear(760, 50, 1000), "b": linear(100, 0, 1000, queued=1000), "c": linear(0, 0, 1000)}
    f = predict_throttle(hot)
    assert f.throttled and f.deficit_blocks == 10 + 100  # c's free blocks do not offset them
    assert [i.instance_id for i in f.instances if i.throttled] == ["a", "b"]


def test_sample_of_status_counts_the_whole_queue_when_memory_holds_its_head_back():
    st = InstanceStatus("a", timestamp=5.0, total_blocks=100, free_blocks=8, used_blocks=92, num_waiting=3,
                        head_of_line_demand_blocks=10, waiting_demand_blocks=30)
    assert sample_of(st) == MemorySample(5.0, 92, 100, 30)


def test_sample_of_status_ignores_a_queue_held_back_by_compute():
    # The head fits in the free blocks: the batch limit or the token budget
    # holds the queue, and more memory would not admit it.
    st = InstanceStatus("a", timestamp=5.0, total_blocks=100, free_blocks=40, used_blocks=60, num_waiting=3,
                        head_of_line_demand_blocks=10, waiting_demand_blocks=30)
    assert sample_of(st) == MemorySample(5.0, 60, 100, 0)


# ---------------------------------------------------------------- planner


def partitions(items: list) -> list[list[list]]:
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for p in partitions(rest):
        out.append([[first]] + p)
        for i in range(len(p)):
            out.append(p[:i] + [[first] + p[i]] + p[i + 1:])
    return out


def sizes_of(plan: BuddyPlan, num_eligible: int) -> list[int]:
    grouped = [len(g.members) for g in plan.groups]
    return grouped + [1] * (num_eligible - sum(grouped))


# Concave group throughputs (the paper's Thpt_g, per group of k instances):
# every extra pipeline stage adds less than a whole instance's throughput.
THROUGHPUTS = [lambda k: k ** 0.7, lambda k: k * (1 - 0.12 * (k - 1))]


def algorithm1(num: int, param_blocks: int, needed: int, cap: int) -> list[int]:
    """The paper's Algorithm 1 as written: merge the two smallest groups until
    the freed memory covers ``needed`` (here also: while the merge fits ``cap``)."""
    sizes = [1] * num
    while len(sizes) > 1 and (num - len(sizes)) * param_blocks < needed:
        sizes.sort()
        if sizes[0] + sizes[1] > cap:
            break
        sizes = [sizes[0] + sizes[1]] + sizes[2:]
    return sizes


def check_shape(plan: BuddyPlan, cands: list[Candidate], num_layers: int, layer_blocks: int):
    eligible = {c.instance_id for c in cands if c.eligible}
    seen = [m.instance_id for g in plan.groups for m in g.members]
    assert len(seen) == len(set(seen)), "an instance in two groups"
    assert set(seen) <= eligible, "an ineligible instance grouped"
    for g in plan.groups:
        assert len(g.members) >= 2
        bounds = [(m.start, m.end) for m in g.members]
        assert bounds[0][0] == 0 and bounds[-1][1] == num_layers
        assert all(s < e for s, e in bounds), "a member keeps no layer"
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds)), "ranges not contiguous"
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1
        for m in g.members:
            assert m.freed_blocks == (num_layers - (m.end - m.start)) * layer_blocks
        assert g.freed_blocks == (len(g.members) - 1) * num_layers * layer_blocks


def random_case(rng: random.Random):
    n = rng.randint(2, 6)
    cands = [Candidate(f"i{i}", rng.randint(0, 200), rng.choice([0, 0, rng.randint(1, 150)]),
                       eligible=rng.random() < 0.85) for i in range(n)]
    num_layers = rng.randint(1, 8)
    layer_blocks = rng.randint(1, 20)
    needed = rng.randint(0, (n - 1) * num_layers * layer_blocks + 5)
    cap = rng.choice([None, rng.randint(1, 6)])
    return cands, num_layers, layer_blocks, needed, cap


@pytest.mark.parametrize("seed", range(300))
def test_greedy_against_brute_force(seed):
    rng = random.Random(seed)
    cands, num_layers, layer_blocks, needed, cap = random_case(rng)
    plan = plan_buddy_groups(cands, needed, num_layers, layer_blocks, cap)
    check_shape(plan, cands, num_layers, layer_blocks)
    if needed <= 0:
        assert plan.groups == ()
        return
    param = num_layers * layer_blocks
    elig = [c.instance_id for c in cands if c.eligible]
    limit = min(num_layers, cap or len(elig))
    every = [[len(g) for g in p] for p in partitions(elig) if all(len(g) <= limit for g in p)]

    def freed(sizes: list[int]) -> int:
        return sum(k - 1 for k in sizes) * param

    covering = [s for s in every if freed(s) >= needed]
    mine = sizes_of(plan, len(elig))
    assert plan.freed_blocks == freed(mine)
    assert plan.covered == bool(covering), "brute force covers and the greedy does not (or the reverse)"
    # The plans to beat: those that cover; where none does, those that free the most (the paper scales out).
    most = max(map(freed, every))
    best = covering or [s for s in every if freed(s) == most]
    # "Just satisfy" R: no plan that covers frees less (so none merges fewer groups).
    assert plan.freed_blocks == min(map(freed, best))
    assert max(mine, default=0) == min(max(s, default=0) for s in best)
    for thpt in THROUGHPUTS:
        assert sum(map(thpt, mine)) >= max(sum(map(thpt, s)) for s in best) - 1e-9
    # Instances disturbed: not the fewest (one big group is), but within the bound.
    fewest = min(sum(k for k in s if k > 1) for s in best)
    assert plan.disturbed <= max(fewest, 2 * fewest - 2)
    # Never worse than the paper's Algorithm 1 as written.
    paper = algorithm1(len(elig), param, needed, limit)
    if (len(elig) - len(paper)) * param >= needed:
        assert plan.covered and plan.freed_blocks == (len(elig) - len(paper)) * param
        assert max(mine) <= max(paper)


def test_six_instances_four_merges_split_three_and_three():
    cands = [Candidate(f"i{i}", 0, 10) for i in range(6)]
    plan = plan_buddy_groups(cands, 4 * 40, num_layers=4, layer_blocks=10)
    assert sorted(len(g.members) for g in plan.groups) == [3, 3] and plan.freed_blocks == 160
    assert sorted(algorithm1(6, 40, 160, 6)) == [2, 4]  # the paper's merge order: a 4-stage pipeline
    capped = plan_buddy_groups(cands, 160, num_layers=4, layer_blocks=10, max_group_size=3)
    assert capped.covered
    assert (6 - len(algorithm1(6, 40, 160, 3))) * 40 < 160  # Algorithm 1 stops at three pairs


def test_disturbed_bound_is_reached():
    # R = 2P on 4 instances: two pairs disturb 4, a group of 3 would disturb 3 (= 2 * 3 - 2).
    plan = plan_buddy_groups([Candidate(f"i{i}", 0) for i in range(4)], 40, num_layers=4, layer_blocks=5)
    assert plan.disturbed == 4 and plan.covered


def test_the_most_throttled_pairs_with_the_freest_eligible():
    cands = [Candidate("hot", 0, 90), Candidate("mid", 40), Candidate("warm", 5, 30),
             Candidate("spare", 100), Candidate("freest", 300, eligible=False), Candidate("calm", 60)]
    plan = plan_buddy_groups(cands, 50, num_layers=4, layer_blocks=25)  # P = 100: one merge
    assert [[m.instance_id for m in g.members] for g in plan.groups] == [["hot", "spare"]]
    assert [(m.start, m.end, m.freed_blocks) for m in plan.groups[0].members] == [(0, 2, 50), (2, 4, 50)]
    two = plan_buddy_groups(cands, 150, num_layers=4, layer_blocks=25)
    assert [[m.instance_id for m in g.members] for g in two.groups] == [["hot", "spare"], ["warm", "calm"]]
    # a throttled instance's free blocks are its own queue's: 40 short with 50 free still ranks above "warm"
    three = plan_buddy_groups(cands + [Candidate("short", 50, 40)], 150, num_layers=4, layer_blocks=25)
    assert [[m.instance_id for m in g.members] for g in three.groups] == [["hot", "spare"], ["short", "calm"]]


def test_no_deficit_no_plan():
    cands = [Candidate(f"i{i}", 10) for i in range(4)]
    for needed in (0, -5):
        plan = plan_buddy_groups(cands, needed, num_layers=8, layer_blocks=4)
        assert plan.groups == () and plan.covered and plan.disturbed == 0


def test_too_few_eligible_or_layers_is_uncovered():
    one = [Candidate("a", 0, 50), Candidate("b", 0, eligible=False)]
    assert plan_buddy_groups(one, 10, num_layers=4, layer_blocks=5).groups == ()
    assert not plan_buddy_groups(one, 10, num_layers=4, layer_blocks=5).covered
    # one layer: no instance can give any up
    assert plan_buddy_groups([Candidate("a", 0), Candidate("b", 0)], 1, num_layers=1, layer_blocks=5).groups == ()


def test_bad_planner_input_raises():
    with pytest.raises(ValueError, match="at least one layer"):
        plan_buddy_groups([Candidate("a", 0)], 10, num_layers=0, layer_blocks=5)
    with pytest.raises(ValueError, match="max_group_size"):
        plan_buddy_groups([Candidate("a", 0)], 10, num_layers=4, layer_blocks=5, max_group_size=0)
    with pytest.raises(ValueError, match="repeat"):
        plan_buddy_groups([Candidate("a", 0), Candidate("a", 5)], 10, num_layers=4, layer_blocks=5)


def test_forecast_feeds_the_planner():
    samples = {"a": linear(760, 50, 1000), "b": linear(100, 0, 1000), "c": linear(900, 0, 1000, queued=400)}
    f = predict_throttle(samples)
    last = {iid: s[-1] for iid, s in samples.items()}
    cands = [Candidate(i.instance_id, last[i.instance_id].total_blocks - last[i.instance_id].used_blocks,
                       i.deficit_blocks) for i in f.instances]
    plan = plan_buddy_groups(cands, f.deficit_blocks, num_layers=40, layer_blocks=8)  # P = 320 >= 10 + 300
    assert plan.covered and plan.disturbed == 2
    assert [m.instance_id for m in plan.groups[0].members] == ["c", "b"]


def _st(t: float, used: int, total: int = 100) -> InstanceStatus:
    return InstanceStatus("a", timestamp=t, total_blocks=total, free_blocks=total - used, used_blocks=used)


def test_add_sample_keeps_new_reports_within_the_window():
    from collections import deque

    w = deque()
    for t in (1.0, 1.5, 1.5, 2.0, 3.2):  # 1.5 twice: the same report read twice counts once
        add_sample(w, _st(t, 10), now=t, window_s=1.0)
    assert [s.time for s in w] == [3.2]
    w.clear()
    for t in (1.0, 1.5, 1.5, 2.0):
        add_sample(w, _st(t, 10), now=t, window_s=1.0)
    assert [s.time for s in w] == [1.0, 1.5, 2.0]


def test_a_member_restores_only_when_its_own_memory_holds_it_and_no_growth_threatens():
    own = 100  # its memory without the lent blocks; the samples show the pool with them (200)
    flat = [MemorySample(t, 70, 200) for t in (0.0, 0.5, 1.0)]
    assert fits_own_memory("a", flat, own, margin=0.2)
    assert not fits_own_memory("a", [MemorySample(t, 85, 200) for t in (0.0, 0.5, 1.0)], own, margin=0.2)
    rising = [MemorySample(0.0, 40, 200), MemorySample(0.5, 60, 200), MemorySample(1.0, 78, 200)]
    assert not fits_own_memory("a", rising, own, margin=0.2)  # 78 fits 80, but within a second it will not fit 100
    assert not fits_own_memory("a", [], own, margin=0.2)


def test_two_pairs_merge_into_four_each_keeping_half_of_its_range():
    g = merge_groups(buddy_group(["a", "b"], 48, 185), buddy_group(["c", "d"], 48, 185), 48, 185)
    assert [(m.instance_id, m.start, m.end, m.freed_blocks) for m in g.members] == [
        ("a", 0, 12, 36 * 185), ("c", 12, 24, 36 * 185), ("b", 24, 36, 36 * 185), ("d", 36, 48, 36 * 185)]
    assert g.freed_blocks == 3 * 48 * 185  # a group of four frees three replicas' parameters


def _any_merge(first, second, layers) -> bool:
    """Brute force: can each layer go to one of its two holders so that every
    member gets a non-empty contiguous range?"""
    def holder(g, i):
        return next(m.instance_id for m in g.members if m.start <= i < m.end)
    choices = [(holder(first, i), holder(second, i)) for i in range(layers)]
    ids = [m.instance_id for m in first.members + second.members]
    for pick in itertools.product(*choices):
        runs = [k for k, _ in itertools.groupby(pick)]
        if sorted(runs) == sorted(ids):  # each member once, as one run
            return True
    return False


@pytest.mark.parametrize("seed", range(200))
def test_a_merge_only_drops_and_covers_every_layer_once(seed):
    rng = random.Random(seed)
    layers = rng.choice([rng.randint(2, 12), rng.randint(2, 64)])
    k1, k2 = rng.randint(1, min(8, layers)), rng.randint(1, min(8, layers))
    ids = [f"i{j}" for j in range(k1 + k2)]
    first, second = buddy_group(ids[:k1], layers, 3), buddy_group(ids[k1:], layers, 3)
    g = merge_groups(first, second, layers, 3)
    if g is None:  # only when no partition keeps every member within its range
        assert not _any_merge(first, second, layers) if layers <= 12 else k1 + k2 > layers // 2
        return
    assert holders_cover(g, layers) and len(g.members) == k1 + k2
    before = {m.instance_id: m for m in first.members + second.members}
    for m in g.members:  # within what it kept: a merge never fetches parameters back
        assert before[m.instance_id].start <= m.start < m.end <= before[m.instance_id].end
        assert m.freed_blocks == (layers - (m.end - m.start)) * 3
    # As even as the ranges allow: with equal groups, exactly the halves.
    if k1 == k2 and all((m.end - m.start) % 2 == 0 for m in first.members):
        assert {m.end - m.start for m in g.members} == {(m.end - m.start) // 2 for m in first.members}


def test_a_merge_refuses_groups_that_do_not_cover_or_share_members():
    a = buddy_group(["a", "b"], 4, 1)
    with pytest.raises(ValueError, match="share members"):
        merge_groups(a, buddy_group(["b", "c"], 4, 1), 4, 1)
    broken = BuddyGroup((Member("x", 0, 1, 3), Member("y", 2, 4, 2)))
    with pytest.raises(ValueError, match="exactly once"):
        merge_groups(a, broken, 4, 1)
    assert merge_groups(buddy_group(["a", "b"], 3, 1), buddy_group(["c", "d"], 3, 1), 3, 1) is None
