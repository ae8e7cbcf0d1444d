"""Statistics over seeds on hand-made summaries."""

import pytest

from ferry.sim.stats import over_seeds, ratios, spread


def summary(p99, mean=1.0, high=0):
    g = {"requests": high, "ttft_ms": {"mean": mean, "p50": mean, "p99": p99}}
    return {"requests": 10, "ttft_ms": {"mean": mean, "p50": mean, "p99": p99}, "decode_ms": {"mean": 2.0},
            "preemptions": 3, "high": g, "normal": g}


def test_spread_is_median_percentiles_and_extremes_of_what_exists():
    s = spread([5.0, 1.0, None, 3.0, 4.0, 2.0])
    assert s["n"] == 5 and s["median"] == 3.0 and (s["min"], s["max"]) == (1.0, 5.0)
    assert s["p10"] == pytest.approx(1.4) and s["p90"] == pytest.approx(4.6)
    assert spread([None])["median"] is None


def test_over_seeds_per_policy_and_metric():
    st = over_seeds({"a": [summary(10), summary(30), summary(20)]})
    assert st["a"]["all"]["TTFT p99"]["median"] == 20 and st["a"]["all"]["preemptions"]["max"] == 3
    assert set(st["a"]) == {"all"}  # no high-priority request: no per-priority groups
    assert set(over_seeds({"a": [summary(1, high=2)]})["a"]) == {"all", "high", "normal"}


def test_ratios_are_per_seed_for_every_ordered_pair():
    r = ratios({"a": [summary(10), summary(30)], "b": [summary(5), summary(60)]})
    assert r["a/b"]["per_seed"] == [2.0, 0.5] and r["a/b"]["median"] == pytest.approx(1.25)
    assert r["b/a"]["per_seed"] == [0.5, 2.0]
    assert ratios({"a": [summary(1)], "b": [summary(0)]})["a/b"]["per_seed"] == [None]


def test_spread_markdown_gives_median_and_p10_p90_per_cell_and_a_dash_for_none():
    from ferry.sim.stats import spread_markdown

    per = {"a": [1.0, 2.0, 3.0], "b": [None, None]}
    out = spread_markdown("m", ["a", "b"], [("x", lambda n: per[n])], digits=1)
    assert out.splitlines() == ["| m | a | b |", "|---|---|---|", "| x | 2.0 [1.2-2.8] | - |"]
