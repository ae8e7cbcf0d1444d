"""The grid's report and the auto-scaling experiment's matching, on
hand-made results."""

import click
import pytest

from ferry.sim.autoscale_cli import match
from ferry.sim.grid import LOSE, TIE, WIN, parse_cell, report, slug, verdict, verdicts


def summary(p99_ms, migrations=0):
    return {"ttft_ms": {"mean": p99_ms / 10, "p99": p99_ms}, "decode_ms": {"mean": 30.0, "p99": 90.0},
            "preemption_loss_ms_mean": 5.0, "migrations": migrations}


def test_cells_and_slugs():
    assert parse_cell("M-M poisson:17") == ("M-M", "poisson:17")
    assert slug("M-M", "gamma:17:2") == "M_M_gamma_17_2"
    with pytest.raises(click.BadParameter):
        parse_cell("M-M")


def test_report_gives_median_spread_and_per_seed_ratio_to_the_baseline():
    result = {"workload": {"lengths": "M-M", "arrivals": "poisson:17", "num_requests": 100}, "seeds": [0, 1, 2],
              "policies": {"infaas++": {}, "llumnix": {}},
              "per_seed": {"infaas++": [summary(10_000), summary(20_000), summary(40_000)],
                           "llumnix": [summary(5_000, 7), summary(5_000, 9), summary(40_000, 8)]}}
    text = report([result], "infaas++")
    row = next(line for line in text.splitlines() if line.startswith("| M-M poisson:17") and "s" in line)
    # P99 TTFT in seconds: infaas++ median 20; llumnix median 5, per-seed ratios 0.5, 0.25, 1 -> 0.5x
    assert "20.00 [" in row and "5.00 [" in row and "0.50x" in row
    assert "### migrations" in text and "| 3 |" in text


def test_autoscale_matches_the_smallest_fleet_no_worse_and_interpolates():
    fleet = [(4, 400.0, 30.0), (6, 600.0, 10.0), (8, 800.0, 2.0)]
    m = match(5.0, fleet)
    assert m["fleet"] == 8 and m["fleet_instance_seconds"] == 800.0
    # log-interpolated between 6 (10 s) and 8 (2 s) at 5 s
    assert 600 < m["interpolated_instance_seconds"] < 800
    assert match(1.0, fleet)["fleet"] is None
    assert match(30.0, fleet)["fleet"] == 4


def test_verdict_needs_a_margin_and_nearly_every_seed():
    assert verdict([0.5, 0.6, 0.7, 0.8, 0.5]) == WIN
    assert verdict([0.5, 0.6, 0.7, 0.8, 1.5]) == TIE  # one seed in five worse: p90 above 1
    assert verdict([0.95, 0.97, 0.99]) == TIE  # better on every seed, but within the margin
    assert verdict([2.0, 3.0, 1.5]) == LOSE
    assert verdict([None, None]) is None
    assert verdict([float("inf"), 2.0, 3.0]) == LOSE  # e.g. preemption loss where the baseline had none
    assert verdict([float("inf"), float("inf"), 3.0]) == LOSE


def test_verdicts_table_judges_each_policy_against_the_baseline():
    result = {"workload": {"lengths": "M-M", "arrivals": "poisson:17", "num_requests": 100}, "seeds": [0, 1, 2],
              "policies": {"infaas++": {}, "llumnix": {}},
              "per_seed": {"infaas++": [summary(10_000), summary(20_000), summary(40_000)],
                           "llumnix": [summary(5_000), summary(5_000), summary(20_000)]}}
    row = next(line for line in verdicts([result], "infaas++").splitlines() if line.startswith("| M-M"))
    # P99 and mean TTFT halved or better on every seed; decode and preemption loss the same
    assert row.count("win") == 2 and row.count("tie (1.00x)") == 2 and "| llumnix |" in row
