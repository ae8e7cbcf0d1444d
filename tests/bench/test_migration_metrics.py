"""ferry bench migration's client stall: the largest inter-token gap across
the migration minus the normal inter-token time."""

from ferry.bench.migration import _flat, client_stall


def test_client_stall_is_the_largest_gap_in_the_window_minus_the_normal_one():
    times = [i * 0.010 for i in range(50)]  # 10 ms apart
    times = times[:25] + [t + 0.045 for t in times[25:]]  # one 55 ms gap ending at 0.295
    stall, itl = client_stall(times, 0.28, 0.29)
    assert round(itl, 6) == 10.0 and round(stall, 6) == 45.0
    assert client_stall(times, 10.0, 11.0) == (None, None)  # no token in the window


def test_flatness_is_longest_over_shortest():
    res = {"256": {"stall_ms": 10.0}, "1024": {"stall_ms": 12.0}, "8000": {"stall_ms": 15.0}}
    assert _flat(res, "stall_ms") == 1.5
    assert _flat({"1": {"stall_ms": None}, "2": {"stall_ms": 1.0}}, "stall_ms") is None
