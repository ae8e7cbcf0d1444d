"""`ferry sim compare`: the `ferry bench compare` JSON, table and plots from
a simulated cluster; statistics over seeds; the same command writes the same
bytes."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from ferry.sim.cli import parse_seeds, sim

KEYS = {"ttft_ms", "decode_ms", "e2e_ms", "preemption_loss_ms_mean", "migrations", "high", "normal"}
ARGS = ["compare", "--policies", "infaas++,llumnix", "--instances", "3", "-n", "60", "--arrivals", "poisson:8",
        "--lengths", "S-S", "--high-priority-fraction", "0.2", "--instance-arg=--headroom-high=20",
        "--no-progress"]


def run(tmp_path, name, *extra):
    out = tmp_path / name
    result = CliRunner().invoke(sim, [*ARGS, "--json", str(out), *extra])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out, result.output


def test_compare_json_is_bench_compare_plus_seed_statistics(tmp_path):
    out, text = run(tmp_path, "a.json", "--seeds", "0-2", "--plots", str(tmp_path / "plots"))
    assert "ratio to llumnix" in text and "median [min - max] over seeds" in text and "P99 TTFT ratio" in text
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"infaas++", "llumnix"} and data["seeds"] == [0, 1, 2]
    for name, s in data["policies"].items():
        assert KEYS <= set(s), name
        assert s["completed"] == s["requests"] == 60 and s["failed"] == 0
        reqs = data["runs"][name]["requests"]
        assert all(r["error"] is None and r["tokens"] == r["output_len"] for r in reqs)
        assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in reqs)
        assert len(data["per_seed"][name]) == 3
        ttft = data["over_seeds"][name]["all"]["TTFT p99"]
        seeds_p99 = sorted(p["ttft_ms"]["p99"] for p in data["per_seed"][name])
        assert (ttft["min"], ttft["median"], ttft["max"]) == pytest.approx(tuple(seeds_p99))
        assert "high" in data["over_seeds"][name]
    ratio = data["p99_ttft_ratios"]["llumnix/infaas++"]
    assert ratio["per_seed"] == pytest.approx([a["ttft_ms"]["p99"] / b["ttft_ms"]["p99"] for a, b in
                                               zip(data["per_seed"]["llumnix"], data["per_seed"]["infaas++"])])
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {"ttft_cdf.png", "latency.png", "freeness.png", "hit_rate.png"} <= names
    # the blocks migrated: drawn when some migration committed
    migrated = any(data["runs"][n]["sim"]["migration_blocks_sent"] for n in data["runs"])
    assert ("migration_blocks.png" in names) == migrated


def test_the_plots_of_prefix_reuse(tmp_path):
    """Hit rate over time from the samples' cumulative counters; blocks
    migrated, sent and linked, per policy (none: no plot)."""
    from ferry.measure import plots

    samples = [{"t": float(t), "prefix_queries": 10 * t, "prefix_hits": 5 * t} for t in range(20)]
    runs = {"a": {"samples": samples, "sim": {"migration_blocks_sent": 30, "migration_blocks_linked": 20}},
            "b": {"samples": samples, "sim": {"migration_blocks_sent": 0, "migration_blocks_linked": 0}}}
    assert plots.hit_rate_timeline(runs, str(tmp_path / "h.png")) == str(tmp_path / "h.png")
    assert plots.migration_blocks(runs, str(tmp_path / "m.png")) == str(tmp_path / "m.png")
    assert (tmp_path / "h.png").stat().st_size > 0 and (tmp_path / "m.png").stat().st_size > 0
    runs["a"]["sim"] = {"migration_blocks_sent": 0, "migration_blocks_linked": 0}
    assert plots.migration_blocks(runs, str(tmp_path / "none.png")) is None
    assert plots.hit_rate_timeline({"c": {"samples": [{"t": 0.0}]}}, str(tmp_path / "x.png")) is None


def test_the_same_command_writes_the_same_bytes(tmp_path):
    a, _ = run(tmp_path, "a.json", "--seeds", "4,5")
    b, _ = run(tmp_path, "b.json", "--seeds", "4,5")
    assert a.read_bytes() == b.read_bytes()
    c, _ = run(tmp_path, "c.json", "--seeds", "4,6")
    assert json.loads(c.read_text())["per_seed"] != json.loads(a.read_text())["per_seed"]


def test_jobs_run_in_worker_processes_and_change_nothing_in_the_json(tmp_path):
    a, _ = run(tmp_path, "a.json", "--seeds", "4,5")
    b, _ = run(tmp_path, "b.json", "--seeds", "4,5", "--jobs", "3")
    assert a.read_bytes() == b.read_bytes()


def test_parse_seeds():
    assert parse_seeds("0-3") == [0, 1, 2, 3]
    assert parse_seeds("5,1,5, 2-3") == [5, 1, 2, 3]
    with pytest.raises(click.BadParameter):
        parse_seeds("a-b")
