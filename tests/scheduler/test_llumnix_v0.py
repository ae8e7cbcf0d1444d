"""llumnix-v0 (libs/common/policies/llumnix_v0.py): Llumnix's first-release
migration rules, in the shared pairing and the instance's choice of request."""

from libs.common import policies
from libs.common.policies.llumnix_v0 import v0_freeness
from libs.common.policies.migration import LAST_RUNNING, next_to_migrate
from libs.common.types import InstanceStatus, Priority, RequestLoad, RequestPhase
from services.scheduler.policies import InstanceView, pair_migrations

V0 = policies.get("llumnix-v0")


def view(iid, total=100, free=100, running=0, waiting=0, hol=0, preempted=0, pending_reqs=0, terminating=False):
    st = InstanceStatus(iid, total_blocks=total, free_blocks=free, num_running=running, num_waiting=waiting,
                        head_of_line_demand_blocks=hol, preempted_waiting=preempted, terminating=terminating)
    return InstanceView(iid, st, 0, pending_reqs)


def pairs(views, policy=V0):
    return [(p.source, p.destination) for p in pair_migrations(
        views, policy.migrate_out_threshold, policy.migrate_in_threshold, policy.migration_freeness,
        policy=policy)]


def test_the_preset_is_registered_with_the_release_rules():
    assert V0.name == "llumnix-v0" and V0.migrates and not V0.uses_priorities
    assert V0.migrate_out_threshold == V0.migrate_in_threshold == -3.0
    assert V0.preempted_sources and not V0.strict_destinations
    assert (V0.order_max_requests, V0.order_pick) == (1, LAST_RUNNING)
    # the current llumnix keeps its own
    full = policies.get("llumnix")
    assert (full.migrate_out_threshold, full.migrate_in_threshold) == (10.0, 20.0)
    assert not full.preempted_sources and full.strict_destinations
    assert (full.order_max_requests, full.order_pick) == (0, "")


def test_v0_freeness_adds_one_to_the_divisor_when_a_request_waits():
    # the watermark: 1% of 100 blocks
    assert v0_freeness(view("a", free=41, running=4)) == 10.0
    assert v0_freeness(view("a", free=41, running=4, waiting=3, hol=15)) == (40 - 15) / 5
    assert v0_freeness(view("a", total=1000, free=410, running=4)) == 100.0
    assert v0_freeness(view("a", free=0, running=0)) == float("inf")  # no request: the least loaded
    assert v0_freeness(view("a", free=50, running=1, terminating=True)) == float("-inf")


def test_one_threshold_of_minus_three_for_sources_and_destinations():
    # F (1 block of watermark): a = (3 - 1 - 12) / 2 = -5 (source), b = (5 - 1) / 2 = 2 (destination),
    # c = -3 exactly (neither)
    views = [view("a", free=3, running=1, waiting=1, hol=12), view("b", free=5, running=2),
             view("c", free=1, running=1, waiting=1, hol=6)]
    assert v0_freeness(views[2]) == -3.0
    assert pairs(views) == [("a", "b")]
    # the current llumnix_base pairs none of them: b is below its in-threshold of 20
    base = policies.get("llumnix_base")
    assert pairs(views, base) == []


def test_a_preempted_request_waiting_makes_a_source_and_rules_out_a_destination():
    # a is roomy (F = 89 / 3) but has a preempted request waiting: a source; b is roomier, none preempted.
    views = [view("a", free=90, running=2, waiting=1, hol=0, preempted=1), view("b", free=95, running=1),
             view("c", free=99, running=1, preempted=1)]
    # c (F = 98) is a source too (preempted), left unpaired, and no destination though the freest
    assert pairs(views) == [("a", "b")]
    # without the rule (llumnix_base's pairing at -3/-3), nobody is a source
    assert pairs(views, policies.get("llumnix_base")) == []


def test_pairing_has_no_queue_or_pending_conditions_on_destinations():
    views = [view("a", free=0, running=4, waiting=1, hol=20),  # F = (0 - 1 - 20) / 5 = -4.2
             view("b", free=60, running=2, waiting=1, hol=4),  # a queue of its own, F = 55 / 3
             view("c", free=30, running=1, pending_reqs=2)]  # dispatches pending, F = 29
    assert pairs(views) == [("a", "c")]  # most loaded source with the least loaded destination
    views.append(view("d", free=1, running=1, waiting=1, hol=20))  # F = -10, the most loaded
    assert pairs(views) == [("d", "c"), ("a", "b")]


def test_strict_destinations_still_hold_for_the_current_presets():
    views = [view("a", free=0, running=4, waiting=1, hol=20), view("b", free=90, running=1, waiting=1, hol=4)]
    assert pairs(views, policies.get("llumnix_base")) == []  # b has a queue


def req(rid, blocks, state=RequestPhase.RUNNING, tokens=None):
    return RequestLoad(rid, Priority.NORMAL, state, blocks, tokens if tokens is not None else blocks * 16)


def test_the_last_running_request_moves_first_whatever_its_size():
    reqs = (req("first", 2), req("big", 40), req("last", 30), req("queued", 8, RequestPhase.WAITING))
    st = InstanceStatus("s", total_blocks=100, free_blocks=20, num_running=3, num_waiting=1,
                        head_of_line_demand_blocks=8, freeness=-2.0, requests=reqs)
    assert next_to_migrate(st, 0, -3.0, False, pick=LAST_RUNNING) == "last"
    assert next_to_migrate(st, 0, -3.0, False, frozenset({"last"}), pick=LAST_RUNNING) == "big"
    # the default rule moves the shortest instead (no head of line blocked)
    assert next_to_migrate(st, 0, -3.0, False) == "first"
    blocked = InstanceStatus("s", total_blocks=100, free_blocks=2, num_running=3, num_waiting=1,
                             head_of_line_demand_blocks=37, freeness=-2.0, requests=reqs)
    assert next_to_migrate(blocked, 0, -3.0, False) == "big"  # the smallest that covers 35 blocks: 40
    assert next_to_migrate(blocked, 0, -3.0, False, pick=LAST_RUNNING) == "last"
    assert next_to_migrate(InstanceStatus("s", requests=(req("w", 1, RequestPhase.WAITING),)), 0, -3.0, False,
                           pick=LAST_RUNNING) is None


def test_an_unknown_pick_is_refused():
    import pytest

    with pytest.raises(ValueError, match="last_running"):
        next_to_migrate(InstanceStatus("s"), 0, 0.0, False, pick="newest")


def test_the_pick_and_the_preempted_count_cross_grpc():
    from libs.common.convert import status_from_pb, status_to_pb
    from libs.pb import instance_pb2 as ipb
    from libs.common.convert import migrate_out_from_pb as order_from_pb

    o = order_from_pb(ipb.MigrateOutRequest(dest_instance_id="d", max_requests=1, pick=LAST_RUNNING))
    assert (o.max_requests, o.pick) == (1, LAST_RUNNING)
    assert status_from_pb(status_to_pb(InstanceStatus("s", preempted_waiting=3))).preempted_waiting == 3
