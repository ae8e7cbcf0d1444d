"""Virtual usage and freeness (Llumnix Algorithm 1, docs/design.md §4)."""

import math

from libs.common.load import TERMINATING_USAGE, summarize, virtual_usages
from libs.common.types import Priority, RequestLoad

N, H = Priority.NORMAL, Priority.HIGH


def req(rid, prio, state, blocks):
    return RequestLoad(rid, prio, state, blocks, blocks * 16)


def test_running_requests_count_blocks_plus_shared_headroom():
    reqs = (req("a", H, "running", 10), req("b", H, "running", 4), req("c", N, "running", 6))
    out = virtual_usages(reqs, 0, {H: 20})
    assert [r.virtual_usage for r in out] == [10 + 10, 4 + 10, 6]


def test_only_head_of_waiting_queue_counts():
    reqs = (req("r", N, "running", 5), req("w1", N, "waiting", 0), req("w2", N, "waiting", 0))
    out = virtual_usages(reqs, head_of_line_demand=30, headroom={})
    assert [r.virtual_usage for r in out] == [5, 30, 0]


def test_freeness_divides_free_space_by_batch_size():
    reqs = (req("a", N, "running", 10), req("b", N, "running", 20), req("w", N, "waiting", 0))
    s = summarize(100, reqs, head_of_line_demand=40, headroom={})
    assert s.virtual_usage == 70
    assert s.freeness == (100 - 70) / 2
    empty = summarize(100, (), 0, {})
    assert empty.freeness == 100  # B = 1 when empty


def test_overload_gives_negative_freeness():
    s = summarize(100, (req("a", N, "running", 90), req("w", N, "waiting", 0)), 50, {})
    assert s.freeness < 0


def test_terminating_instance_has_fake_request_of_infinite_usage():
    s = summarize(100, (req("a", N, "running", 1),), 0, {}, terminating=True)
    assert s.virtual_usage >= TERMINATING_USAGE
    assert s.freeness < -1e9 and math.isfinite(s.freeness)


def test_normal_freeness_ignores_high_priority_load():
    reqs = (req("a", H, "running", 50), req("b", N, "running", 10))
    s = summarize(100, reqs, 0, {H: 30})
    assert s.normal_freeness == (100 - 10) / 1
    assert s.freeness == (100 - (50 + 30) - 10) / 2


def test_shared_blocks_count_once_and_cached_free_ones_not_at_all():
    """Prefix caching: two running requests hold 3 blocks alone each and share
    4 (a cached prefix); 20 cached blocks nobody uses are free. Freeness is
    the free space as it is: 100 - (3 + 3 + 4) over 2."""
    reqs = (req("a", N, "running", 3), req("b", N, "running", 3))
    s = summarize(100, reqs, head_of_line_demand=0, headroom={}, shared_blocks=4)
    assert s.virtual_usage == 10 and s.freeness == 45
    assert summarize(100, reqs, 0, {}, shared_blocks=4).normal_freeness == 45
