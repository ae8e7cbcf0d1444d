"""Metric computation on hand-made timelines."""

from __future__ import annotations

import pytest

from ferry.measure.metrics import RequestRecord, stats_ms, summarize, ttft_cdf


def rec(i, prio, sent, first, last, done, tokens, **kw) -> RequestRecord:
    return RequestRecord(i, prio, 10, tokens, scheduled_at=sent, sent_at=sent, first_token_at=first,
                         last_token_at=last, finished_at=done, tokens=tokens, finish_reason="length", **kw)


def test_one_request():
    r = rec(0, "normal", 10.0, 10.5, 12.5, 12.6, 5)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.decode_s == pytest.approx(0.5)  # 2 s over 4 tokens after the first
    assert r.e2e_s == pytest.approx(2.6)
    assert rec(1, "normal", 0, 1, 1, 1, 1).decode_s is None  # one token: no decode latency


def test_summary_overall_and_per_priority():
    rs = [rec(0, "high", 0.0, 0.1, 1.1, 1.1, 11, preemptions=1, preemption_loss_ms=40.0, migrations=2),
          rec(1, "normal", 1.0, 1.3, 2.3, 2.3, 11),
          rec(2, "normal", 2.0, 2.5, 4.5, 4.5, 21),
          RequestRecord(3, "normal", 10, 5, scheduled_at=3.0, sent_at=3.0, error="HTTP 400: bad")]
    s = summarize(rs)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(300.0)
    assert s["decode_ms"]["mean"] == pytest.approx(100.0)
    assert s["e2e_ms"]["mean"] == pytest.approx((1100 + 1300 + 2500) / 3)
    assert s["preemptions"] == 1 and s["migrations"] == 2
    assert s["preemption_loss_ms_mean"] == pytest.approx(40.0 / 3)
    assert s["errors"] == {"HTTP 400: bad": 1}
    assert s["duration_s"] == pytest.approx(4.5)
    assert s["output_tokens_per_s"] == pytest.approx(43 / 4.5)
    h, n = s["high"], s["normal"]
    assert (h["requests"], h["completed"]) == (1, 1)
    assert h["ttft_ms"] == {"mean": pytest.approx(100.0), "p50": pytest.approx(100.0), "p99": pytest.approx(100.0)}
    assert h["preemption_loss_ms_mean"] == pytest.approx(40.0)
    assert (n["requests"], n["completed"], n["failed"]) == (3, 2, 1)
    assert n["ttft_ms"]["mean"] == pytest.approx(400.0)
    assert n["migrations"] == 0


def test_time_scale_divides_durations_not_send_lag():
    rs = [RequestRecord(0, "normal", 1, 3, scheduled_at=0.0, sent_at=0.2, first_token_at=1.2, last_token_at=3.2,
                        finished_at=3.2, tokens=3, finish_reason="length", preemption_loss_ms=100.0)]
    s = summarize(rs, scale=10)
    assert s["ttft_ms"]["mean"] == pytest.approx(100.0)
    assert s["decode_ms"]["mean"] == pytest.approx(100.0)
    assert s["preemption_loss_ms_mean"] == pytest.approx(10.0)
    assert s["send_lag_ms"]["mean"] == pytest.approx(200.0)


def test_percentiles_and_short_outputs():
    assert stats_ms([]) == {"mean": None, "p50": None, "p99": None}
    st = stats_ms([i / 1000 for i in range(1, 101)])
    assert st["p50"] == pytest.approx(50.5) and st["p99"] == pytest.approx(99.01)
    r = rec(0, "normal", 0, 1, 2, 2, 4)
    r.output_len = 5
    assert summarize([r])["short_outputs"] == 1


def test_ttft_cdf():
    x, y = ttft_cdf([rec(i, "normal", 0, t, t, t, 1) for i, t in enumerate([0.3, 0.1, 0.2])])
    assert list(x) == pytest.approx([100, 200, 300]) and list(y) == pytest.approx([1 / 3, 2 / 3, 1])


def test_the_longest_stall_is_summarized_only_when_streamed():
    rs = [rec(0, "normal", 0.0, 0.1, 1.1, 1.1, 11, max_gap_s=0.4), rec(1, "normal", 0.0, 0.1, 1.1, 1.1, 11,
                                                                        max_gap_s=0.2)]
    s = summarize(rs)
    assert s["max_gap_ms"]["mean"] == pytest.approx(300.0) and s["max_gap_ms"]["p50"] == pytest.approx(300.0)
    plain = [rec(0, "normal", 0.0, 0.1, 1.1, 1.1, 11)]
    assert "max_gap_ms" not in summarize(plain)  # not streamed (the simulator): the summary is as before
    assert "max_gap_s" not in plain[0].to_dict() and rs[0].to_dict()["max_gap_s"] == 0.4


def test_the_benches_percentile_is_a_sample_by_nearest_rank():
    from ferry.measure.metrics import percentile

    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # a value that occurred, not an interpolation
    assert percentile(list(range(1, 101)), 99) == 100 and percentile(list(range(1, 101)), 0) == 1
    assert percentile([5.0, 1.0], 50) == 5.0  # rank floor(0.5 x 2) = 1 of the sorted two
