"""An instance's status report as a pure function of its published load, and
the choice of requests of a migrate-out order."""

import pytest

from libs.common.types import InstanceStatus, Priority, RequestLoad
from services.instance.engine.base import EngineLoad
from libs.common.policies.migration import accepts_migration, head_of_line_shortfall, next_to_migrate
from services.instance.status import instance_status, material

LOAD = EngineLoad(total_blocks=100, free_blocks=50, block_size=16, requests=(
    RequestLoad("a", Priority.NORMAL, "running", 20, 300),
    RequestLoad("h", Priority.HIGH, "running", 10, 100),
    RequestLoad("w1", Priority.NORMAL, "waiting", 0, 64),
    RequestLoad("w2", Priority.NORMAL, "waiting", 0, 32),
), head_of_line_demand_blocks=4, waiting_demand_blocks=6, num_preemptions=3, reserved_blocks=5)


def test_status_counts_virtual_usage_headroom_and_reserved_blocks():
    s = instance_status("i", 7, 123.0, LOAD, {Priority.HIGH: 20}, migrating_in=1, migrating_out=2)
    assert (s.instance_id, s.seq, s.timestamp) == ("i", 7, 123.0)
    assert (s.num_running, s.num_waiting, s.num_preemptions) == (2, 2, 3)
    assert s.used_blocks == 100 - 50 - 5  # blocks reserved for incoming migrations are not "used"
    # V: 20 + (10 + 20 headroom) + 4 (head of line) + 0 + 5 reserved for a
    # migration in = 59; F = (100 - 59) / 2 running
    assert s.virtual_usage == pytest.approx(59) and s.freeness == pytest.approx(20.5)
    assert s.normal_freeness == pytest.approx((100 - 24 - 5) / 1)
    assert (s.migrating_in, s.migrating_out, s.terminating) == (1, 2, False)
    assert [r.virtual_usage for r in s.requests] == [20, 30, 4, 0]
    assert instance_status("i", 1, 0.0, LOAD, {}, terminating=True).freeness < -1e9


def test_material_ignores_token_counts_only():
    more_tokens = EngineLoad(**{**LOAD.__dict__, "requests": tuple(
        RequestLoad(r.request_id, r.priority, r.state, r.physical_blocks, r.num_tokens + 1) for r in LOAD.requests)})
    assert material(more_tokens) == material(LOAD)
    one_more_block = EngineLoad(**{**LOAD.__dict__, "free_blocks": 49})
    assert material(one_more_block) != material(LOAD)


def status(freeness: float, terminating: bool = False) -> InstanceStatus:
    reqs = (RequestLoad("long", Priority.NORMAL, "running", 30, 480),
            RequestLoad("short", Priority.NORMAL, "running", 2, 20),
            RequestLoad("high", Priority.HIGH, "running", 1, 10),
            RequestLoad("queued", Priority.NORMAL, "waiting", 0, 5))
    return InstanceStatus("i", freeness=freeness, terminating=terminating, requests=reqs)


def test_next_to_migrate_moves_the_cheapest_until_no_longer_a_source():
    assert next_to_migrate(status(2.0), 0, 10.0, use_priorities=False) == "high"
    assert next_to_migrate(status(2.0), 0, 10.0, use_priorities=True) == "short"  # normal before high
    # An overloaded source (F < 0) keeps going; one that is not, and has no
    # blocked head of line, stops after one (the scheduler pairs it again).
    assert next_to_migrate(status(-2.0), 1, 10.0, False, frozenset({"high"})) == "short"
    assert next_to_migrate(status(2.0), 1, 10.0, False, frozenset({"high"})) is None
    # The first migration always starts; later ones stop once freeness is above the threshold...
    assert next_to_migrate(status(12.0), 0, 10.0, False) == "high"
    assert next_to_migrate(status(12.0), 1, 10.0, False) is None
    # ...unless the instance is terminating (it drains).
    assert next_to_migrate(status(12.0, terminating=True), 1, 10.0, False) == "high"
    assert next_to_migrate(status(-2.0), 3, 10.0, False, frozenset({"high", "short", "long"})) is None


def test_the_order_moves_the_fewest_tokens_to_send_where_the_destination_holds_prefixes():
    """``linkable``: request id -> its first blocks the destination holds
    (linked there, not sent): the cheapest move is the fewest tokens net of them."""
    # long: 480 tokens, 29 of its 30 blocks held -> 16 to send; short: 20; high: 10
    assert next_to_migrate(status(2.0), 0, 10.0, False, linkable={"long": 29}) == "high"
    assert next_to_migrate(status(2.0), 0, 10.0, True, linkable={"long": 29}) == "long"  # normal first: 16 < 20
    assert next_to_migrate(status(2.0), 0, 10.0, True, linkable={"long": 28}) == "short"  # 32 > 20


def blocked(free: int, head: int, freeness: float = 2.0, terminating: bool = False) -> InstanceStatus:
    """A source whose head of line needs ``head`` blocks with ``free`` free."""
    reqs = (RequestLoad("r40", Priority.NORMAL, "running", 40, 640),
            RequestLoad("r25", Priority.NORMAL, "running", 25, 400),
            RequestLoad("r10", Priority.NORMAL, "running", 10, 160),
            RequestLoad("h30", Priority.HIGH, "running", 30, 480),
            RequestLoad("head", Priority.NORMAL, "waiting", 0, 16 * head))
    return InstanceStatus("i", total_blocks=200, free_blocks=free, num_running=4, num_waiting=1,
                          head_of_line_demand_blocks=head, freeness=freeness, terminating=terminating,
                          requests=reqs)


def test_defragmentation_moves_the_smallest_request_that_covers_the_shortfall():
    assert head_of_line_shortfall(blocked(free=5, head=25)) == 20
    assert next_to_migrate(blocked(5, 25), 0, 10.0, False) == "r25"  # not the shortest (r10), not r30
    assert next_to_migrate(blocked(5, 14), 0, 10.0, False) == "r10"
    # Priorities: a high-priority request moves only when no normal one is left.
    assert next_to_migrate(blocked(5, 35), 0, 10.0, False) == "h30"
    assert next_to_migrate(blocked(5, 35), 0, 10.0, True) == "r40"


def test_defragmentation_moves_the_covering_request_that_sends_the_fewest_tokens():
    # 20 blocks short: r40, r25 and h30 cover it. Where the destination holds 30 of r40's blocks, r40 sends
    # 640 - 480 = 160 tokens against r25's 400; with 10 held, 480: r25 again (and h30 never before both).
    assert blocked(5, 25).block_size == 16
    assert next_to_migrate(blocked(5, 25), 0, 10.0, False, linkable={"r40": 30}) == "r40"
    assert next_to_migrate(blocked(5, 25), 0, 10.0, False, linkable={"r40": 10}) == "r25"
    assert next_to_migrate(blocked(5, 25), 0, 10.0, False, linkable={"h30": 29, "r40": 1}) == "h30"
    assert next_to_migrate(blocked(5, 25), 0, 10.0, True, linkable={"h30": 29, "r40": 1}) == "r25"
    # None covers alone: still the largest first; what it sends breaks ties only.
    assert next_to_migrate(blocked(5, 80), 0, 10.0, True, linkable={"r25": 25}) == "r40"


def test_defragmentation_moves_the_largest_first_when_none_covers_alone():
    assert next_to_migrate(blocked(5, 80), 0, 10.0, True) == "r40"
    assert next_to_migrate(blocked(5, 80), 1, 10.0, True, frozenset({"r40"})) == "r25"


def test_order_stops_once_the_head_fits_or_freeness_is_above_the_threshold():
    assert next_to_migrate(blocked(5, 25), 1, 10.0, False, frozenset({"r10"})) == "r25"  # still blocked
    assert next_to_migrate(blocked(30, 25), 1, 10.0, False, frozenset({"r25"})) is None  # the head fits now
    assert next_to_migrate(blocked(5, 25, freeness=12.0), 1, 10.0, False) is None  # no longer a source
    # The first migration of an order always starts (the scheduler saw a source).
    assert next_to_migrate(blocked(30, 25), 0, 10.0, False) == "r10"  # nothing blocked: the cheapest
    # Terminating: drain regardless.
    assert next_to_migrate(blocked(30, 25, freeness=50.0, terminating=True), 1, 10.0, False) == "r10"


def test_destination_refuses_with_a_queue_or_below_its_threshold():
    free = InstanceStatus("d", total_blocks=200, num_running=4, virtual_usage=100.0)
    assert accepts_migration(free, 20, 10.0) == (True, "")  # (200 - 120) / 5 = 16
    ok, reason = accepts_migration(free, 60, 10.0)  # (200 - 160) / 5 = 8
    assert not ok and "freeness" in reason
    queued = InstanceStatus("d", total_blocks=200, num_running=4, num_waiting=1, virtual_usage=100.0)
    ok, reason = accepts_migration(queued, 1, 10.0)
    assert not ok and "queue" in reason


def test_a_handoff_is_refused_only_by_a_terminating_destination():
    """A Splitwise handoff brings the decode instance its own work: neither
    its queue nor the freeness floor refuses it (live and simulated
    destinations both ask accepts_migration)."""
    queued = InstanceStatus("d", total_blocks=200, num_running=4, num_waiting=3, virtual_usage=180.0)
    assert accepts_migration(queued, 60, 10.0, handoff=True) == (True, "")
    assert not accepts_migration(queued, 60, 10.0)[0]
    leaving = InstanceStatus("d", total_blocks=200, num_running=0, virtual_usage=0.0, terminating=True)
    ok, reason = accepts_migration(leaving, 1, handoff=True)
    assert not ok and "terminating" in reason
