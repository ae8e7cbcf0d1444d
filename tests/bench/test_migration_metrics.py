"""ferry bench migration's client stall: the largest inter-token gap across
the migration minus the normal inter-token time."""

from ferry.bench.migration import _flat, client_stall, largest_gap, stall_breakdown


def test_client_stall_is_the_largest_gap_in_the_window_minus_the_normal_one():
    times = [i * 0.010 for i in range(50)]  # 10 ms apart
    times = times[:25] + [t + 0.045 for t in times[25:]]  # one 55 ms gap ending at 0.295
    stall, itl = client_stall(times, 0.28, 0.29)
    assert round(itl, 6) == 10.0 and round(stall, 6) == 45.0
    assert client_stall(times, 10.0, 11.0) == (None, None)  # no token in the window
    # a window that ended before the gap takes it in when told to go through it
    assert client_stall(times, 0.0, -0.1)[0] < 40 and round(client_stall(times, 0.0, -0.1, 0.295)[0], 6) == 45.0


def test_flatness_is_longest_over_shortest():
    res = {"256": {"stall_ms": 10.0}, "1024": {"stall_ms": 12.0}, "8000": {"stall_ms": 15.0}}
    assert _flat(res, "stall_ms") == 1.5
    assert _flat({"1": {"stall_ms": None}, "2": {"stall_ms": 1.0}}, "stall_ms") is None


def test_the_switch_gap_splits_into_its_parts_on_the_clients_clock():
    times = [i * 0.010 for i in range(20)] + [0.190 + 0.070 + i * 0.010 for i in range(10)]
    # Suspended 2 ms after token 19 arrived; acknowledged 15 ms later; in the
    # destination's batch 30 ms after the suspend; its first token 38 ms later.
    parts = stall_breakdown(times, suspend=0.192, ack_ms=15.0, downtime_ms=30.0)
    assert parts["switch_token"] == 20 and round(parts["switch_gap_ms"], 6) == 70.0
    assert round(parts["source_tail_ms"], 6) == 2.0 and parts["ack_to_batch_ms"] == 15.0
    assert round(parts["batch_to_client_ms"], 6) == 38.0
    assert round(parts["source_tail_ms"] + parts["ack_to_batch_ms"] + parts["commit_ack_ms"]
                 + parts["batch_to_client_ms"], 6) == parts["switch_gap_ms"]
    gap, token = largest_gap(times, 0.1, 0.2)
    assert token == 20 and round(gap, 6) == 70.0
    assert stall_breakdown(times, suspend=0.192, ack_ms=15.0, downtime_ms=0.0) is None  # downtime unknown
    assert stall_breakdown(times, suspend=1.0, ack_ms=15.0, downtime_ms=30.0) is None  # no token after
