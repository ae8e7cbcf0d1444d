"""Pending dispatches (pure, clock passed in): counted until a report lists
the request or the TTL passes."""

from libs.common.pending import PendingDispatches


def test_pending_until_a_report_lists_the_request():
    p = PendingDispatches(ttl_s=2.0)
    p.add("a", "r1", 3, now=10.0)
    p.add("a", "r2", 5, now=10.5)
    p.add("b", "r3", 1, now=10.5)
    assert p.totals("a", now=11.0) == (8, 2)
    p.settle("a", ["r1", "other"], now=11.0)
    assert p.totals("a", now=11.0) == (5, 1)
    assert p.totals("b", now=11.0) == (1, 1)
    assert p.totals("c", now=11.0) == (0, 0)


def test_ttl_drops_stale_entries_from_totals_and_on_settle():
    p = PendingDispatches(ttl_s=2.0)
    p.add("a", "r1", 3, now=10.0)
    assert p.totals("a", now=12.0) == (3, 1)  # at the TTL: still counted
    assert p.totals("a", now=12.01) == (0, 0)
    p.add("a", "r2", 4, now=12.0)
    p.settle("a", [], now=12.01)  # r1 is gone for good, r2 stays
    assert p.totals("a", now=12.5) == (4, 1)


def test_drop_forgets_an_instance():
    p = PendingDispatches()
    p.add("a", "r1", 3, now=0.0)
    p.drop("a")
    assert p.totals("a", now=0.0) == (0, 0)
