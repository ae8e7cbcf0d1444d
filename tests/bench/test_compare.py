"""`ferry bench compare` end to end on a tiny fake-engine cluster: the JSON has
every key per policy and every request completed with its token count."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ferry.bench.cli import bench

KEYS = {"ttft_ms", "decode_ms", "e2e_ms", "preemption_loss_ms_mean", "migrations", "high", "normal"}


def test_compare_fake_cluster(tmp_path):
    out = tmp_path / "compare.json"
    plots = tmp_path / "plots"
    result = CliRunner().invoke(bench, [
        "compare", "--policies", "round_robin,llumnix", "--engine", "fake", "--instances", "2",
        "--token-delay-ms", "2", "-n", "20", "--arrivals", "poisson:40", "--lengths", "fixed:24:12",
        "--high-priority-fraction", "0.3", "--seed", "3", "--no-progress",
        "--json", str(out), "--plots", str(plots)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "ratio to llumnix" in result.output
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"round_robin", "llumnix"}
    for name, s in data["policies"].items():
        assert KEYS <= set(s), name
        for key in ("ttft_ms", "decode_ms", "e2e_ms"):
            assert set(s[key]) == {"mean", "p50", "p99"}
            assert s[key]["mean"] > 0
            for prio in ("high", "normal"):
                assert set(s[prio][key]) == {"mean", "p50", "p99"}
        assert s["completed"] == s["requests"] == 20 and s["failed"] == 0
        assert s["high"]["requests"] + s["normal"]["requests"] == 20 and s["high"]["requests"] > 0
        reqs = data["runs"][name]["requests"]
        assert len(reqs) == 20
        assert all(r["error"] is None and r["tokens"] == r["output_len"] == 12 for r in reqs)
        assert all(r["finish_reason"] == "length" for r in reqs)
    # Same seed, same workload for every policy.
    a, b = (data["runs"][n]["requests"] for n in ("round_robin", "llumnix"))
    assert [(r["prompt_len"], r["priority"]) for r in a] == [(r["prompt_len"], r["priority"]) for r in b]
    assert {p.name for p in plots.iterdir()} == {"ttft_cdf.png", "latency.png", "freeness.png"}


def test_serving_rejects_bad_workload():
    result = CliRunner().invoke(bench, ["serving", "--engine", "fake", "--arrivals", "uniform:1",
                                        "--url", "http://127.0.0.1:9", "--no-progress"])
    assert result.exit_code != 0
    assert "poisson:RATE" in result.output
