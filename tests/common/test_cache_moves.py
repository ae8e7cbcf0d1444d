"""Cache-move pairing (libs/common/policies/cache_moves.py, llumnix-move):
an instance whose queue, pending dispatches and floor exceed its plain free
blocks moves what it keeps, at most its shortfall, to the instance with the
most room (which keeps a higher floor, has no queue, and takes one order a
round); nothing moves where nothing is kept, nor from or to a busy or
terminating instance."""

from __future__ import annotations

from libs.common.policies.base import InstanceView
from libs.common.policies.cache_moves import DEST_FLOOR, SOURCE_FLOOR, pair_cache_moves, room, shortfall
from libs.common.types import InstanceStatus

TOTAL = 1000


def view(iid: str, free: int, kept: int = 0, waiting_demand: int = 0, waiting: int = 0, pending: int = 0,
         terminating: bool = False) -> InstanceView:
    s = InstanceStatus(iid, total_blocks=TOTAL, free_blocks=free, kept_blocks=kept, num_waiting=waiting,
                       waiting_demand_blocks=waiting_demand, terminating=terminating)
    return InstanceView(iid, s, pending_blocks=pending, pending_requests=1 if pending else 0)


def test_a_source_moves_at_most_what_it_keeps_and_what_it_lacks():
    floor = int(SOURCE_FLOOR * TOTAL)
    assert shortfall(view("a", free=floor + 50, kept=300)) == 0  # room enough
    assert shortfall(view("a", free=floor - 40, kept=300)) == 40
    assert shortfall(view("a", free=10, kept=300, waiting_demand=200, waiting=1)) == 290
    assert shortfall(view("a", free=10, kept=30, waiting_demand=200, waiting=1)) == 30  # all it keeps
    assert shortfall(view("a", free=10, kept=0, waiting_demand=200, waiting=1)) == 0


def test_a_destination_keeps_its_own_floor_and_takes_nothing_with_a_queue():
    floor = int(DEST_FLOOR * TOTAL)
    assert room(view("b", free=floor + 120)) == 120
    assert room(view("b", free=floor + 120, pending=20)) == 0  # a dispatch on its way
    assert room(view("b", free=floor + 120, waiting=1, waiting_demand=5)) == 0
    assert room(view("b", free=floor - 1)) == 0
    assert room(view("b", free=TOTAL, terminating=True)) == 0


def test_the_shortest_source_goes_to_the_roomiest_destination_each_once_a_round():
    views = [view("a", free=0, kept=400, waiting_demand=100, waiting=2),  # short of 200
             view("c", free=50, kept=100),  # short of 50
             view("b", free=900), view("d", free=500), view("e", free=200)]
    pairs = pair_cache_moves(views)
    assert [(p.source, p.destination, p.blocks) for p in pairs] == [("a", "b", 200), ("c", "d", 50)]
    # the roomiest one busy: the next; e has no room above its floor, so c waits for the next round
    assert [(p.source, p.destination, p.blocks) for p in pair_cache_moves(views, frozenset({"b"}))] == [("a", "d", 200)]


def test_nothing_pairs_without_a_destination_or_a_source():
    assert pair_cache_moves([view("a", free=0, kept=400, waiting_demand=100, waiting=2), view("b", free=250)]) == []
    assert pair_cache_moves([view("a", free=900, kept=400), view("b", free=900)]) == []
