"""Workload generators: seeded, rates and burstiness as specified, length
distributions matching the paper's Table 1, clipping reported."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from ferry.measure import workload as wl


def gaps(w: wl.Workload) -> np.ndarray:
    return np.diff([r.arrival_s for r in w.requests])


def test_same_seed_same_workload_and_independent_streams():
    a = wl.build("poisson:5", "M-M", 500, seed=7, high_priority_fraction=0.2)
    b = wl.build("poisson:5", "M-M", 500, seed=7, high_priority_fraction=0.2)
    assert a.requests == b.requests
    c = wl.build("poisson:5", "S-L", 500, seed=7, high_priority_fraction=0.2)
    # Changing the lengths leaves arrivals and priorities alone.
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in c.requests]
    assert [r.priority for r in a.requests] == [r.priority for r in c.requests]
    assert wl.build("poisson:5", "M-M", 500, seed=8).requests != a.requests


def test_poisson_rate_and_cv():
    w = wl.build("poisson:4", "fixed:1:1", 20000, seed=1)
    g = gaps(w)
    assert w.requests[0].arrival_s == 0.0
    assert 1 / g.mean() == pytest.approx(4, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_rate_and_cv(cv):
    g = gaps(wl.build(f"gamma:10:{cv}", "fixed:1:1", 40000, seed=2))
    assert 1 / g.mean() == pytest.approx(10, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.08)


def test_phases_step_the_rate_and_repeat():
    w = wl.build("phases:4@50,20@50", "fixed:1:1", 24000, seed=4)
    t = np.array([r.arrival_s for r in w.requests])
    # Arrivals counted per phase over the first 10 cycles (the first arrival is moved to 0).
    low = [((t >= c * 100) & (t < c * 100 + 50)).sum() / 50 for c in range(10)]
    high = [((t >= c * 100 + 50) & (t < c * 100 + 100)).sum() / 50 for c in range(10)]
    assert np.mean(low) == pytest.approx(4, rel=0.1) and np.mean(high) == pytest.approx(20, rel=0.05)
    assert min(high) > 2 * max(low)
    assert 1 / gaps(w).mean() == pytest.approx(12, rel=0.05)  # the mean rate
    assert wl.build("phases:4@50,20@50", "fixed:1:1", 500, seed=4).requests == \
        wl.build("phases:4@50,20@50", "fixed:1:1", 500, seed=4).requests


def test_a_phase_at_rate_zero_is_a_pause():
    t = np.array([r.arrival_s for r in wl.build("phases:10@5,0@20", "fixed:1:1", 300, seed=1).requests])
    # Arrivals lie in [0, 5) of every 25 s, shifted back by the first one (< 5 s): never in [5, 20).
    assert t[-1] > 125 and not ((t % 25 >= 5.0) & (t % 25 < 20.0)).any()


def test_time_scale_divides_arrivals():
    a = wl.build("poisson:2", "fixed:1:1", 100, seed=3)
    b = wl.build("poisson:2", "fixed:1:1", 100, seed=3, time_scale=4)
    assert b.duration_s == pytest.approx(a.duration_s / 4)


# (mean, p50, p99) of Table 1 in the Llumnix paper.
TABLE1 = {"S": (128, 38, 1464), "M": (256, 32, 4208), "L": (512, 55, 5166)}


@pytest.mark.parametrize("name", ["S", "M", "L"])
def test_power_law_matches_table1(name):
    mean, p50, p99 = TABLE1[name]
    x, p = wl.power_law_pmf(name)
    assert (x * p).sum() == pytest.approx(mean, rel=1e-6)
    assert x.min() == 1 and x.max() == wl.POWER_LAW_MAX
    cdf = np.cumsum(p)
    assert x[np.searchsorted(cdf, 0.5)] == pytest.approx(p50, rel=0.1)
    assert x[np.searchsorted(cdf, 0.99)] == pytest.approx(p99, rel=0.15)
    # Sampled: input and output are drawn independently from their own laws.
    w = wl.build("poisson:1", f"{name}-{name}", 30000, seed=4)
    ins = np.array([r.prompt_len for r in w.requests])
    outs = np.array([r.output_len for r in w.requests])
    assert ins.mean() == pytest.approx(mean, rel=0.06)
    assert outs.mean() == pytest.approx(mean, rel=0.06)
    assert ins.max() <= 6000 and ins.min() >= 1
    assert abs(np.corrcoef(ins, outs)[0, 1]) < 0.03


def test_mixed_pair_and_fixed():
    w = wl.build("poisson:1", "S-L", 20000, seed=5)
    assert np.mean([r.prompt_len for r in w.requests]) == pytest.approx(128, rel=0.06)
    assert np.mean([r.output_len for r in w.requests]) == pytest.approx(512, rel=0.06)
    f = wl.build("poisson:1", "fixed:12:34", 10)
    assert {(r.prompt_len, r.output_len) for r in f.requests} == {(12, 34)}


def test_sharegpt_and_trace_lengths():
    s = wl.build("poisson:1", "sharegpt", 20000, seed=6)
    # README: ShareGPT stats input mean 2340, output mean 439.
    assert np.mean([r.prompt_len for r in s.requests]) == pytest.approx(2340, rel=0.05)
    assert np.mean([r.output_len for r in s.requests]) == pytest.approx(439, rel=0.05)
    t = wl.build(f"trace:{wl.AZURE_CONV}", "trace", 19366, time_scale=2.0)
    # README: one hour, mean 5.5 req/s; input mean 1155, output mean 211.
    assert len(t.requests) / t.duration_s == pytest.approx(2 * 5.5, rel=0.05)
    assert np.mean([r.prompt_len for r in t.requests]) == pytest.approx(1155, rel=0.02)
    assert np.mean([r.output_len for r in t.requests]) == pytest.approx(211, rel=0.02)


def test_traces_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRY_TRACES_DIR", str(tmp_path))
    assert wl.traces_dir() == tmp_path
    with pytest.raises(wl.WorkloadError, match="FERRY_TRACES_DIR"):
        wl.build("poisson:1", "sharegpt", 5)
    monkeypatch.delenv("FERRY_TRACES_DIR")
    assert (wl.traces_dir() / wl.SHAREGPT_STATS).is_file()


def test_default_traces_live_in_the_repository_with_their_licenses(monkeypatch):
    monkeypatch.delenv("FERRY_TRACES_DIR", raising=False)
    repo = pathlib.Path(wl.__file__).resolve().parents[2]
    folder = wl.traces_dir()
    assert folder == repo / "data" / "traces"
    files = {p.name for p in folder.iterdir()}
    assert {wl.AZURE_CONV, wl.SHAREGPT_STATS, "README.md"} <= files
    assert any(f.startswith("LICENSE.AzurePublicDataset") for f in files)
    assert any(f.startswith("LICENSE.sarathi-serve") for f in files)


def test_clipping_is_reported_and_fits():
    w = wl.build("poisson:1", "L-L", 5000, seed=9, max_model_len=2048)
    assert all(r.prompt_len + r.output_len <= 2048 for r in w.requests)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in w.requests)
    n = sum(r.clipped for r in w.requests)
    assert w.clip.clipped == n > 0 and w.clip.total == 5000
    assert w.clip.tokens_after < w.clip.tokens_before
    assert "clipped" in w.clip.line()
    assert wl.clip_to_context(3000, 1000, 2048) == (1536, 512)
    assert wl.clip_to_context(10, 10, 2048) == (10, 10)


def test_high_priority_fraction():
    w = wl.build("poisson:1", "fixed:1:1", 20000, seed=10, high_priority_fraction=0.1)
    assert sum(r.priority == "high" for r in w.requests) / 20000 == pytest.approx(0.1, rel=0.08)


@pytest.mark.parametrize("arrivals,lengths", [("poisson:x", "M-M"), ("poisson:0", "M-M"), ("uniform:3", "M-M"),
                                              ("gamma:1", "M-M"), ("poisson:1", "X-M"), ("poisson:1", "fixed:3"),
                                              ("phases:4", "M-M"), ("phases:0@10", "M-M"),
                                              ("phases:4@0", "M-M"), ("phases:-1@5,2@5", "M-M")])
def test_bad_specs_say_what_is_accepted(arrivals, lengths):
    with pytest.raises(wl.WorkloadError):
        wl.build(arrivals, lengths, 10)


def test_prompt_ids_deterministic_in_range():
    r = wl.build("poisson:1", "fixed:50:1", 2).requests[1]
    ids = wl.prompt_ids(r, 0, 97, 123)
    assert ids == wl.prompt_ids(r, 0, 97, 123) and len(ids) == 50
    assert min(ids) >= 97 and max(ids) < 123
