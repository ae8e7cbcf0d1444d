"""ferry sim sweep-stats on hand-made grid results: the per-cell median and
the paper's maximum over the sweep are different statistics."""

import json
import math

from click.testing import CliRunner

from ferry.sim.sweep_stats import gain, sweep_stats, sweep_stats_cmd


def summary(p99_s, mean_s, loss_ms):
    return {"ttft_ms": {"p99": p99_s * 1000, "mean": mean_s * 1000}, "preemption_loss_ms_mean": loss_ms}


def cell(arrivals, base, pol, seeds=(0, 1, 2)):
    """base, pol: per seed (p99 s, mean s, loss ms) of infaas++ and llumnix."""
    return {"workload": {"lengths": "M-M", "arrivals": arrivals, "num_requests": 100}, "seeds": list(seeds),
            "policies": {"infaas++": {}, "llumnix": {}},
            "per_seed": {"infaas++": [summary(*b) for b in base], "llumnix": [summary(*p) for p in pol]}}


# P99 gains (infaas++ / llumnix) per seed: cell A 2, 2, 2; cell B 1, 10, 1; cell C 1, 1, 30.
CELLS = [cell("poisson:1", [(2, 1, 100)] * 3, [(1, 1, 50)] * 3),
         cell("poisson:2", [(5, 2, 100), (50, 8, 100), (5, 2, 100)], [(5, 2, 100), (5, 1, 10), (5, 2, 100)]),
         cell("poisson:3", [(3, 3, 40)] * 2 + [(90, 9, 40)], [(3, 3, 40)] * 2 + [(3, 1, 0)])]


def test_the_median_over_cells_and_the_maximum_over_the_sweep_differ():
    out = sweep_stats(CELLS, [("llumnix", "infaas++")])["pairs"]["llumnix/infaas++"]
    p99 = out["P99 TTFT"]
    # per cell, the median over seeds: 2, 1, 1 -> median over cells 1
    assert [c["median"] for c in p99["per_cell"]["cells"]] == [2.0, 1.0, 1.0]
    assert p99["per_cell"]["over_cells"]["median"] == 1.0
    # the paper's: per seed the maximum over cells 2, 10, 30 -> median 10, range 2-30; overall 30 (cell C, seed 2)
    assert [p["max"] for p in p99["max_over_cells"]["per_seed"]] == [2.0, 10.0, 30.0]
    assert [p["cell"] for p in p99["max_over_cells"]["per_seed"]] == ["M-M poisson:1 n=100", "M-M poisson:2 n=100",
                                                                      "M-M poisson:3 n=100"]
    over = p99["max_over_cells"]["over_seeds"]
    assert (over["median"], over["min"], over["max"]) == (10.0, 2.0, 30.0)
    assert p99["max_overall"] == {"value": 30.0, "cell": "M-M poisson:3 n=100", "seed": 2}
    # mean TTFT: per seed maxima 1, 8, 9
    assert [p["max"] for p in out["mean TTFT"]["max_over_cells"]["per_seed"]] == [1.0, 8.0, 9.0]
    # preemption loss is a reduction: 50%, 90% (cell B, seed 1) and 100% (llumnix at 0, cell C, seed 2)
    loss = out["preemption loss"]
    assert [p["max"] for p in loss["max_over_cells"]["per_seed"]] == [0.5, 0.9, 1.0]
    assert loss["per_cell"]["over_cells"]["median"] == 0.0  # cells' medians 0.5, 0, 0


def test_gains_and_what_counts_nowhere():
    assert gain(1.0, 4.0, "speedup") == 4.0 and gain(0.0, 4.0, "speedup") == math.inf
    assert gain(1.0, 4.0, "reduction") == 0.75
    assert gain(1.0, 0.0, "speedup") is None and gain(None, 4.0, "reduction") is None
    # a pair whose policy did not run gives no value
    out = sweep_stats(CELLS, [("llumnix_base", "infaas++")])["pairs"]["llumnix_base/infaas++"]
    assert out["P99 TTFT"]["max_overall"] is None and out["P99 TTFT"]["per_cell"]["over_cells"]["n"] == 0


def test_the_command_reads_a_folder_and_writes_json(tmp_path):
    for i, c in enumerate(CELLS):
        (tmp_path / f"cell{i}.json").write_text(json.dumps(c))
    (tmp_path / "other.json").write_text(json.dumps({"not": "a cell"}))
    out = tmp_path / "stats.json"
    r = CliRunner().invoke(sweep_stats_cmd, ["--grid", str(tmp_path), "--pairs", "llumnix/infaas++",
                                             "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "3 cells" in r.output and "| llumnix/infaas++ | P99 TTFT | 1.00x [1.00x-1.80x] | 10.00x [2.00x-30.00x]" \
        in r.output
    data = json.loads(out.read_text())
    assert data["pairs"]["llumnix/infaas++"]["P99 TTFT"]["max_overall"]["value"] == 30.0
