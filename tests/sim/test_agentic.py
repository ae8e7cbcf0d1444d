"""Agent programs (issue 53): the ``agentic`` workload (ferry/measure/prefixes.py,
the same for ``ferry bench`` and ``ferry sim``), its turns resending the whole
history after the previous turn's end plus the tool latency, each naming its
program at dispatch; and the program metrics (ferry/measure/programs.py):
completion time, turn TTFT, prompt tokens of returning turns computed rather
than served by the prefix cache."""

from __future__ import annotations

import dataclasses
import types
from collections import Counter

import numpy as np
import pytest

from ferry.bench.client import request_body
from ferry.measure import prefixes, programs
from ferry.measure import workload as wl
from ferry.measure.metrics import RequestRecord
from ferry.sim import scheduler as sim_scheduler
from ferry.sim.run import Cluster, SimOptions, simulate


def test_agentic_turns_resend_the_history_and_share_one_system_prompt():
    w = prefixes.build("poisson:0.5", "M-M", 300, "agentic", seed=3)
    by = {}
    for r in w.requests:
        by.setdefault(r.session, []).append(r)
    assert len(by) == 300  # -n counts programs
    systems = {r.segments[0] for r in w.requests if r.turn == 0}
    assert systems == {wl.Segment(prefixes.key(prefixes.AGENT_SYSTEM, 0), 3000)}
    news, outs = [], []
    for turns in by.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        first = turns[0]
        assert first.prompt_len == 3000 + first.segments[1].length and first.think_s == 0.0
        for prev, r in zip(turns, turns[1:]):
            (new,) = r.segments
            assert r.prompt_len == prev.prompt_len + prev.output_len + new.length  # the whole history again
            assert r.arrival_s == first.arrival_s and r.think_s > 0
        news += [s.length for r in turns for s in r.segments[-1:]]
        outs += [r.output_len for r in turns]
    n_turns = [len(t) for t in by.values()]
    assert 30 <= np.median(n_turns) <= 46  # median 38
    assert 1300 <= np.median(news) <= 1700 and 370 <= np.median(outs) <= 480
    tools = [r.think_s for r in w.requests if r.turn > 0]
    assert 13.5 <= np.mean(tools) <= 16.5  # exponential, mean 15 s
    starts = sorted(t[0].arrival_s for t in by.values())
    assert 1.7 <= np.mean(np.diff(starts)) <= 2.3  # Poisson, 0.5 programs a second


def test_agentic_parameters_scale_and_the_context_ends_programs():
    w = prefixes.build("poisson:1", "M-M", 50, "agentic:8:2:10", seed=0, max_model_len=2048)
    assert all(r.prompt_len + r.output_len <= 2048 for r in w.requests)
    assert {r.segments[0].length for r in w.requests if r.turn == 0} == {300}
    assert w.clip.clipped > 0  # programs cut where their context ran out
    assert 1.5 <= np.mean([r.think_s for r in w.requests if r.turn > 0]) <= 2.5
    assert prefixes.build("poisson:1", "M-M", 50, "agentic:8:2:10", seed=0, max_model_len=2048).requests == \
        w.requests  # seeded
    for bad in ("agentic:0", "agentic:8:-1", "agentic:8:2:0", "agentic:x", "agentic:1:2:3:4"):
        with pytest.raises(wl.WorkloadError):
            prefixes.build("poisson:1", "M-M", 5, bad)


def test_a_turn_names_its_program_in_the_body_and_at_dispatch(monkeypatch):
    w = prefixes.build("poisson:1", "M-M", 3, "agentic:3:1:20", seed=0)
    assert request_body(w.requests[1], [1, 2], None)["prompt_cache_key"] == f"program-{w.requests[1].session}"
    assert "prompt_cache_key" not in request_body(w.requests[1], [1, 2], None, ferry_priority=False)
    seen = []
    real = sim_scheduler.place

    def spy(dispatcher, views, req):
        seen.append((req.request_id, req.program_id))
        return real(dispatcher, views, req)

    monkeypatch.setattr(sim_scheduler, "place", spy)
    opts = SimOptions(instances=2, prefix="agentic:3:1:20", arrivals="poisson:1", num_requests=3, progress=False)
    out = simulate(opts, "llumnix-prefix")
    work = opts.workload(1.0, 13616)
    assert sorted(seen) == sorted((f"req-{r.index}", f"program-{r.session}") for r in work.requests)
    assert out["summary"]["programs"]["turns"] == len(work.requests)


def test_the_sim_counts_what_returning_turns_recomputed():
    """Four instances with room for every program: a returning turn finds its
    history cached where llumnix-prefix sends it (nothing of the prefix
    recomputed); prefix-blind round robin recomputes most of it. Every turn
    resends exactly the previous prompt and its answer."""
    opts = SimOptions(instances=4, prefix="agentic:5:2:10", arrivals="poisson:0.5", num_requests=12,
                      progress=False)
    held = {}

    def keep(cluster):
        held["c"] = cluster
        return types.SimpleNamespace(summary=dict)

    res = {p: simulate(opts, p, extend=keep if p == "llumnix-prefix" else None)["summary"]["programs"]
           for p in ("llumnix-prefix", "round_robin")}
    c: Cluster = held["c"]
    for i, r in enumerate(c.work.requests):
        if r.turn > 0:
            prev = c.prev_turn[i]
            assert c.prompts[i][:len(c.prompts[prev]) + len(c.answers[prev])] == \
                tuple(c.prompts[prev]) + tuple(c.answers[prev])
            assert len(c.prompts[i]) == r.prompt_len
    good, blind = res["llumnix-prefix"], res["round_robin"]
    assert good["programs_completed"] == good["programs"] == 12
    assert good["prefix_recomputed_fraction"] < 0.05 < 0.25 < blind["prefix_recomputed_fraction"]
    assert good["returning_computed_tokens"] < blind["returning_computed_tokens"]
    assert 0 < good["returning_computed_fraction"] < blind["returning_computed_fraction"] < 1
    assert good["completion_ms"]["p50"] > 0 and good["turn_ttft_ms"]["p99"] >= good["turn_ttft_ms"]["p50"]


def test_program_summary_by_hand():
    reqs = [wl.Request(0, 0.0, 100, 10, "normal", session=0, turn=0),
            wl.Request(1, 0.0, 150, 10, "normal", session=0, turn=1),  # history 110 -> 96 in blocks of 16
            wl.Request(2, 0.0, 50, 5, "normal", session=1, turn=0),
            wl.Request(3, 0.0, 80, 5, "normal")]  # no program: left out
    recs = [RequestRecord(0, "normal", 100, 10, 0.0, sent_at=0.0, first_token_at=0.5, finished_at=1.0,
                          cached_tokens=0),
            RequestRecord(1, "normal", 150, 10, 3.0, sent_at=3.0, first_token_at=3.25, finished_at=4.0,
                          cached_tokens=64),
            RequestRecord(2, "normal", 50, 5, 1.0, sent_at=1.0, error="boom", cached_tokens=0),
            RequestRecord(3, "normal", 80, 5, 0.0, sent_at=0.0, first_token_at=0.1, finished_at=0.2)]
    s = programs.summary(reqs, recs, 16)
    assert (s["programs"], s["programs_completed"], s["turns"], s["returning_turns"]) == (2, 1, 3, 1)
    assert s["completion_ms"]["p50"] == pytest.approx(4000.0)
    assert s["turn_ttft_ms"]["p50"] == pytest.approx(375.0)
    assert (s["returning_prompt_tokens"], s["returning_computed_tokens"]) == (150, 86)
    assert (s["prefix_tokens"], s["prefix_recomputed_tokens"]) == (96, 32)
    assert s["prefix_recomputed_fraction"] == pytest.approx(1 / 3)
    unknown = [dataclasses.replace(r, cached_tokens=None) for r in recs]
    assert programs.summary(reqs, unknown, 16)["prefix_recomputed_fraction"] is None
    assert programs.summary(reqs[3:], recs[3:], 16) is None
    assert "llumnix" in programs.table({"llumnix": {"programs": s}}) and programs.table({"x": {}}) == ""
    assert Counter(r.session for r in reqs)[0] == 2


def test_continuum_pins_programs_between_turns_and_every_pin_ends():
    """The continuum policy sets its TTL on the simulated engines: turns end
    pinning their program's blocks; after the run and the TTL no pin, no
    request and no used block is left, and the pools are consistent."""
    from libs.common.policies import get

    opts = SimOptions(instances=2, prefix="agentic:4:2:10", arrivals="poisson:0.5", num_requests=6, progress=False)
    work = opts.workload(1.0, 13616)
    c = Cluster(opts, "continuum", work)
    assert all(i.engine.pins.ttl_s == get("continuum").program_ttl_s == 30.0 for i in c.instances.values())
    c.run()
    assert sum(i.engine.pins.pinned_total for i in c.instances.values()) > 0
    left = c.settle(horizon_s=get("continuum").program_ttl_s + 5.0)
    assert left == {"requests": 0, "used_blocks": 0, "reserved_blocks": 0, "handoffs_under_way": 0}
    assert all(len(i.engine.pins) == 0 for i in c.instances.values())
    c.close()
    plain = Cluster(opts, "llumnix-prefix", work)
    assert all(i.engine.pins.ttl_s == 0 for i in plain.instances.values())
    plain.close()


def test_the_sim_scheduler_counts_each_programs_turns_and_llumnix_keep_spreads_first_turns(monkeypatch):
    """DispatchRequest.program_turn is the ledger's count of the program's
    earlier turns (0 at its first), as the live scheduler's; llumnix-keep
    starts programs where the most blocks are free, llumnix-prefix where the
    shared system prompt is cached."""
    seen, firsts = [], {}
    real = sim_scheduler.place

    def spy(dispatcher, views, req):
        placed = real(dispatcher, views, req)
        seen.append((req.program_id, req.program_turn))
        if req.program_turn == 0:
            firsts.setdefault(dispatcher.name, []).append(placed.prefill)
        return placed

    monkeypatch.setattr(sim_scheduler, "place", spy)
    opts = SimOptions(instances=4, prefix="agentic:3:2:10", arrivals="poisson:0.5", num_requests=4, progress=False)
    for p in ("llumnix-prefix", "llumnix-keep"):
        seen.clear()
        simulate(opts, p)
        by = {}
        for prog, n in seen:
            by.setdefault(prog, []).append(n)
        assert len(by) == 4 and all(ns == list(range(len(ns))) for ns in by.values())
    assert len(set(firsts["llumnix-prefix"])) == 1  # every program where the system prompt was cached first
    assert len(set(firsts["llumnix-keep"])) == 4


def test_llumnix_move_moves_kept_blocks_between_simulated_instances_and_leaks_none():
    """llumnix-move on the simulator runs the live cache move (the
    rescheduler's order, the source's CacheMove, the destination's
    commit_cache) on the virtual clock: kept blocks of programs move from
    instances short of room, every program completes, and after the run
    no request, used or reserved block is left and every pool is exact."""
    opts = SimOptions(instances=2, prefix="agentic:38:15:10", arrivals="poisson:0.2", num_requests=6,
                      progress=False, max_model_len=12000)
    c = Cluster(opts, "llumnix-move", opts.workload(1.0, 12000))
    c.run()
    moved = c.scheduler.cache_move_summary(1)
    assert moved["committed"] > 0 and moved["blocks_sent"] > 0
    assert all(o.request_id.startswith("program:") for o in c.scheduler.cache_moves)
    assert not any(o.request_id.startswith("program:") for o in c.scheduler.outcomes)
    assert c.recorder.done == len(c.work.requests) and not any(r.error for r in c.recorder.records)
    left = c.settle(horizon_s=200.0)
    assert left == {"requests": 0, "used_blocks": 0, "reserved_blocks": 0, "handoffs_under_way": 0}
    for i in c.instances.values():
        i.engine.check_integrity()
    c.close()
