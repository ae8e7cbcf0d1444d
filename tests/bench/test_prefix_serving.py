"""Prefix workloads end to end on fake instances: multi-turn sessions send
the conversation so far (the answers as the engines made them), every
answer is the fake model's for its whole prompt (prefix hits included), and
the bench JSON carries the cluster's hit rate and its upper bound."""

from __future__ import annotations

from ferry.measure import workload as wl
from ferry.bench.serving import ServingOptions, run_serving
from services.instance.engine.fake import fake_generate


def test_sessions_carry_the_answers_and_hit_the_cache():
    opts = ServingOptions(arrivals="poisson:20", lengths="fixed:40:8", prefix="sessions:3:0.05", num_requests=12,
                          seed=4, instances=1, engine="fake", token_delay_ms=3, progress=False)
    run = run_serving(opts, "round_robin")
    s = run["summary"]
    assert s["completed"] == 12, s["errors"]
    pc = s["prefix_cache"]
    # one instance: every later turn finds the conversation so far (whole
    # blocks), the first turns find nothing
    assert pc["hits"] > 0 and pc["hit_rate"] == pc["upper_bound"]["hit_rate"]
    assert run["workload"]["prefix"] == "sessions:3:0.05"


def test_records_hold_each_turn_after_the_previous_answer():
    from ferry.bench import client
    from ferry.measure import prefixes
    from ferry.cluster import ClusterSpec, LocalCluster, free_port
    import asyncio

    work = prefixes.build("poisson:20", "fixed:20:6", 6, "sessions:3:0.01", seed=2)
    c = LocalCluster(ClusterSpec(instances=2, engine="fake", port=free_port(), dispatch="round_robin",
                                 instance_args=["--token-delay-ms", "2"]))
    c.start(timeout_s=60)
    try:
        records = asyncio.run(client.replay(c.url, work, (97, 123)))
    finally:
        c.stop()
    by: dict[int, list] = {}
    for req, rec in zip(work.requests, records):
        assert rec.ok, rec.error
        assert rec.output_ids == fake_generate(rec.prompt_ids, req.output_len)
        assert len(rec.prompt_ids) == req.prompt_len
        by.setdefault(req.session, []).append(rec)
    for turns in by.values():
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt_ids[: len(prev.prompt_ids) + 6] == prev.prompt_ids + prev.output_ids
    assert wl.prompt_ids(work.requests[1], 2, 97, 123) == records[1].prompt_ids[-20:]
