"""Dispatch and migration policies on hand-made snapshots (no gRPC)."""

import dataclasses

import pytest

from libs.common.types import InstanceStatus, Priority, RequestLoad, RequestPhase
from services.scheduler.policies import (
    Dispatcher,
    DispatchRequest,
    InstanceView,
    MoveCosts,
    PromptHashes,
    base_freeness,
    pair_migrations,
)


def view(iid, total=100, used=0, running=0, hol=0, waiting_demand=0, freeness=None, terminating=False,
         pending=0, pending_reqs=0):
    f = freeness if freeness is not None else (total - used - hol) / max(1, running)
    st = InstanceStatus(iid, total_blocks=total, free_blocks=total - used, num_running=running,
                        head_of_line_demand_blocks=hol, waiting_demand_blocks=waiting_demand,
                        used_blocks=used, freeness=f, terminating=terminating)
    return InstanceView(iid, st, pending, pending_reqs)


REQ = DispatchRequest("r", 32, Priority.NORMAL)


def test_llumnix_picks_highest_freeness():
    views = [view("a", used=50, running=5), view("b", used=80, running=1), view("c", used=10, running=9)]
    # F: a=10, b=20, c=10
    assert Dispatcher("llumnix").choose(views, REQ) == "b"


def test_llumnix_counts_headroom_through_reported_freeness():
    # b has few blocks in use but a high-priority request's headroom makes it less free.
    views = [view("a", used=40, running=2), view("b", used=10, running=1, freeness=5.0)]
    assert Dispatcher("llumnix").choose(views, REQ) == "a"
    # llumnix_base ignores headroom: b is freer by raw usage.
    assert Dispatcher("llumnix_base").choose(views, REQ) == "b"


def test_pending_dispatches_spread_a_burst():
    views = [view("a", used=0, running=0, pending=0), view("b", used=0, running=0, pending=30, pending_reqs=1)]
    assert Dispatcher("llumnix").choose(views, REQ) == "a"


def test_infaas_counts_queued_demand():
    views = [view("a", used=30, waiting_demand=40), view("b", used=50, waiting_demand=0)]
    assert Dispatcher("infaas++").choose(views, REQ) == "b"


def test_round_robin_cycles_in_id_order():
    d = Dispatcher("round_robin")
    views = [view("b"), view("a"), view("c")]
    assert [d.choose(views, REQ) for _ in range(4)] == ["a", "b", "c", "a"]


def test_terminating_and_excluded_instances_are_skipped():
    views = [view("a", used=90, running=1), view("b", terminating=True), view("c", used=0)]
    req = DispatchRequest("r", 1, Priority.NORMAL, frozenset({"c"}))
    assert Dispatcher("llumnix").choose(views, req) == "a"


def test_unknown_policy_lists_supported_names():
    with pytest.raises(ValueError, match=r"round_robin, infaas\+\+, llumnix_base, llumnix"):
        Dispatcher("best")


def test_pairs_lowest_source_with_highest_destination():
    views = [view("s1", freeness=-5, running=4), view("s2", freeness=2, running=3),
             view("d1", freeness=80, running=1), view("d2", freeness=95, running=1), view("m", freeness=30)]
    pairs = pair_migrations(views, out_threshold=10, in_threshold=60)
    assert [(p.source, p.destination) for p in pairs] == [("s1", "d2"), ("s2", "d1")]


def test_terminating_instance_is_a_source_never_a_destination():
    views = [view("t", freeness=90, running=2, terminating=True), view("d", freeness=90, running=1)]
    pairs = pair_migrations(views, out_threshold=10, in_threshold=60)
    assert [(p.source, p.destination) for p in pairs] == [("t", "d")]


def test_busy_instances_are_not_paired():
    views = [view("s", freeness=-5, running=4), view("d", freeness=95)]
    assert pair_migrations(views, 10, 60, busy=frozenset({"d"})) == []


def test_instances_that_cannot_migrate_are_not_paired():
    """A vLLM instance without Ferry's connector (InstanceInfo.no_migration)
    is neither a source nor a destination."""
    src, dst = view("s", freeness=-5, running=4), view("d", freeness=95)
    lite = InstanceView("d", dst.status, migratable=False)
    assert pair_migrations([src, lite], 10, 60) == []
    assert [(p.source, p.destination) for p in pair_migrations([src, dst], 10, 60)] == [("s", "d")]
    lite_src = InstanceView("s", src.status, migratable=False)
    assert pair_migrations([lite_src, dst], 10, 60) == []


def test_base_freeness_counts_head_of_line_demand():
    v = view("a", total=100, used=40, running=2, hol=30)
    assert base_freeness(v) == (100 - 40 - 30) / 2


def test_llumnix_dispatch_counts_the_new_requests_demand():
    # "pair" runs two long requests: most free blocks per request, but only
    # 30 free; "busy" runs ten short ones with 60 free. A 40-block prompt
    # fits only on "busy".
    views = [view("pair", used=70, running=2), view("busy", used=40, running=10)]
    assert base_freeness(views[0]) > base_freeness(views[1])  # 15 > 6: as the instances stand
    req = DispatchRequest("long", 40 * 16, Priority.NORMAL)
    for policy in ("llumnix", "llumnix_base"):
        assert Dispatcher(policy).choose(views, req) == "busy", policy
    # A small request still goes where the freeness per request is highest.
    small = DispatchRequest("short", 16, Priority.NORMAL)
    assert Dispatcher("llumnix").choose(views, small) == "pair"


def test_llumnix_dispatch_sees_the_whole_queue_not_only_its_head():
    # "queued": 30 free blocks, a 2-block head of line and nine more requests
    # (80 blocks in all) waiting behind it. "steady": 20 free blocks, nothing
    # waiting. Algorithm 1 freeness (migration) counts only the head, so
    # "queued" looks freer per request, even with the new request added;
    # dispatch counts the queue and picks "steady".
    q = InstanceStatus("queued", total_blocks=100, free_blocks=30, num_running=1, num_waiting=10,
                       head_of_line_demand_blocks=2, waiting_demand_blocks=80, used_blocks=70,
                       freeness=(100 - 70 - 2) / 1)
    st = InstanceStatus("steady", total_blocks=100, free_blocks=20, num_running=4, num_waiting=0,
                        used_blocks=80, freeness=(100 - 80) / 4)
    views = [InstanceView("queued", q), InstanceView("steady", st)]
    assert base_freeness(views[0]) > base_freeness(views[1])  # 28 > 5
    assert (100 - 70 - 2 - 2) / 2 > (100 - 80 - 2) / 5  # head of line only, new request added: 13 > 3.6
    for policy in ("llumnix", "llumnix_base"):
        assert Dispatcher(policy).choose(views, REQ) == "steady", policy


# --- Dispatch when memory is short (docs/design.md §5, issue 16) -------------------------------------

def short_view(iid, total, used, running, waiting=0, waiting_demand=0):
    """An instance with ``waiting`` queued requests of ``waiting_demand`` blocks in all."""
    hol = waiting_demand if waiting == 1 else 0
    st = InstanceStatus(iid, total_blocks=total, free_blocks=total - used, num_running=running,
                        num_waiting=waiting, head_of_line_demand_blocks=hol, waiting_demand_blocks=waiting_demand,
                        used_blocks=used, freeness=(total - used - hol) / max(1, running))
    return InstanceView(iid, st)


@pytest.mark.parametrize("policy", ["llumnix", "llumnix_base", "infaas++"])
def test_when_nothing_fits_the_smallest_shortfall_wins_not_the_longest_queue(policy):
    # Q: 40 queued, 104 blocks short with the new request; S: 1 queued, 54 short.
    # Dividing the negative room by the load (-104/51 > -54/12) picked Q.
    q = short_view("q", total=100, used=100, running=10, waiting=40, waiting_demand=102)
    s = short_view("s", total=100, used=100, running=10, waiting=1, waiting_demand=52)
    assert Dispatcher(policy).choose([q, s], REQ) == "s"


@pytest.mark.parametrize("policy", ["llumnix", "llumnix_base"])
def test_a_prompt_that_fits_nowhere_goes_where_the_shortfall_is_smallest(policy):
    # 5,915 tokens = 370 blocks. A: 340 free, 10 running (30 short); B: 250 free,
    # 60 running (120 short). -30/11 < -120/61 picked B, the busier one.
    a = short_view("a", total=851, used=511, running=10)
    b = short_view("b", total=851, used=601, running=60)
    assert Dispatcher(policy).choose([a, b], DispatchRequest("long", 5915, Priority.NORMAL)) == "a"


@pytest.mark.parametrize("policy", ["llumnix", "llumnix_base"])
def test_fitting_exactly_beats_one_block_short(policy):
    # 2 blocks asked. "exact": room 0 after it (freeness 0, a big batch);
    # "short": one block short but an almost empty batch.
    exact = short_view("exact", total=100, used=98, running=40)
    short = short_view("short", total=100, used=99, running=1)
    assert Dispatcher(policy).choose([exact, short], REQ) == "exact"
    assert Dispatcher(policy).choose([short, exact], REQ) == "exact"
    # Among instances where it fits, the highest freeness, as before.
    roomy = short_view("roomy", total=100, used=60, running=2)
    assert Dispatcher(policy).choose([exact, short, roomy], REQ) == "roomy"


def test_fit_key_orders_by_freeness_then_by_shortfall():
    from libs.common.policies import fit_key

    assert fit_key(100, 100, 5) == (1, 0.0)
    assert fit_key(100, 101, 1) == (0, -1)
    assert fit_key(100, 100, 5) > fit_key(100, 101, 1) > fit_key(100, 150, 1)
    assert fit_key(100, 80, 1) > fit_key(100, 50, 5)  # freeness 20 > 10


def test_an_instance_with_a_queue_is_never_a_destination():
    src = view("s", freeness=-5, running=4)
    queued = InstanceView("q", InstanceStatus("q", total_blocks=100, free_blocks=90, num_running=1, num_waiting=1,
                                              head_of_line_demand_blocks=95, freeness=95.0))
    assert pair_migrations([src, queued], 10, 60) == []
    assert [(p.source, p.destination) for p in pair_migrations([src, queued, view("d", freeness=70)], 10, 60)] \
        == [("s", "d")]


def test_reserved_blocks_count_in_base_freeness():
    # 20 blocks reserved for an incoming migration: free 50, used 30.
    st = InstanceStatus("a", total_blocks=100, free_blocks=50, used_blocks=30, num_running=2)
    assert base_freeness(InstanceView("a", st)) == (100 - 50) / 2


def _running(iid, freeness, *reqs):
    """A source whose running requests are ``(request id, blocks)``."""
    v = view(iid, freeness=freeness, running=len(reqs))
    loads = tuple(RequestLoad(rid, Priority.NORMAL, RequestPhase.RUNNING, blocks, blocks * 16) for rid, blocks in reqs)
    return InstanceView(iid, dataclasses.replace(v.status, requests=loads))


def test_pairing_by_move_cost_sends_a_source_where_its_next_request_links_its_prefix():
    """llumnix-prefix's pairing: each source (lowest freeness first) takes the
    destination where the request it would move first sends the fewest
    blocks; with no prefix held anywhere, llumnix's pairs."""
    s1 = _running("s1", -5, ("big", 40), ("small", 10))  # moves "small" first (fewest blocks)
    s2 = _running("s2", 2, ("x", 20))
    views = [s1, s2, view("d1", freeness=80, running=1), view("d2", freeness=95, running=1)]
    hashes = PromptHashes()
    hashes.put("small", (1, 2, 3, 4))
    hashes.put("x", (7, 8))
    held = {"d1": {1, 2, 3}, "d2": {7}}  # d1 holds small's first 3 blocks, d2 x's first
    lookups = []

    def held_prefix(h):
        lookups.append(h)
        out = {}
        for iid, cached in held.items():
            n = 0
            while n < len(h) and h[n] in cached:
                n += 1
            if n:
                out[iid] = n
        return out

    cost = MoveCosts(hashes, held_prefix, out_threshold=10, use_priorities=False)
    assert cost(s1, views[2]) == 7 and cost(s1, views[3]) == 10 and cost(s2, views[3]) == 19
    assert cost.linkable(s1, "d1") == {"small": 3} and cost.linkable(s2, "d2") == {"x": 1}
    assert len(lookups) == 2  # each prompt once, however many pairs ask ("big" has no hashes: none)
    pairs = pair_migrations(views, 10, 60, cost=cost)
    assert [(p.source, p.destination) for p in pairs] == [("s1", "d1"), ("s2", "d2")]
    assert [(p.source, p.destination) for p in pair_migrations(views, 10, 60)] == [("s1", "d2"), ("s2", "d1")]
    held.clear()
    cost = MoveCosts(hashes, held_prefix, out_threshold=10, use_priorities=False)
    assert [(p.source, p.destination) for p in pair_migrations(views, 10, 60, cost=cost)] == \
        [("s1", "d2"), ("s2", "d1")]


def test_prompt_hashes_keep_the_newest():
    h = PromptHashes(capacity=2)
    for rid in "abc":
        h.put(rid, (ord(rid),))
    assert h.get("a") == () and h.get("c") == (ord("c"),) and len(h) == 2
