"""One trace per request, across processes: a fake-engine cluster (real
processes, gRPC between them) exports its spans over OTLP to a receiver in
this test (ferry/trace_sink.py). A client request with its own
``traceparent`` is migrated twice (instance A -> B -> C) and resumed once
(C's engine dies; the frontend resumes it on A or B by recompute). Its trace
must hold parent-linked spans from the frontend, the scheduler, the source
and both destinations, under the client's span, and the frontend's spans
(its dispatches and instance calls, one after the other) must add up to the
request's span, which must match the client's own latency."""

from __future__ import annotations

import asyncio
import os
import secrets
import time

import httpx
import pytest

from ferry.cluster import ClusterSpec, LocalCluster, free_port
from ferry.trace_sink import TraceSink
from tests.helpers import find_instance_of, migrate

# Bounds (ms). Measured on the 2-core development machine in 3 runs of a 3.1 s request: the
# client's latency exceeded the request's span by 0.5-2.9 ms; the frontend's segments left
# 2.9-7.4 ms of it uncovered, in 7 gaps of 0.2-2.8 ms each (body parsing and tokenization before
# the first dispatch, the resume's decision, the closing SSE events). The bounds leave room for a
# descheduled process on a loaded machine: a full local CI run (two workers beside SmolLM2 tests)
# once left a first gap of 6.4 ms. A phase the frontend does not span would show as a gap of tens
# of ms or more; a segment missing altogether is caught by the list of segment names.
CLIENT_SLACK_MS = 8.0
GAP_MS = 20.0
UNCOVERED_MS = 40.0
DIE_AFTER_STEPS = 12  # C's engine: this many steps after the migrated request arrives there


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    sink = TraceSink().start()
    old = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"  # the children export every 50 ms
    # instance-2 (C) has half the KV blocks: dispatch never picks it first (its freeness is lower);
    # its engine dies a few steps after a request arrives there.
    spec = ClusterSpec(instances=3, engine="fake", port=free_port(), log_dir=str(tmp_path_factory.mktemp("traced")),
                       otlp_endpoint=sink.endpoint, scheduler_args=["--no-migration"],
                       instance_args=["--token-delay-ms", "20", "--num-blocks", "1024"],
                       per_instance_args={2: ["--num-blocks", "512",
                                              "--failpoints", f"engine.die_after_steps={DIE_AFTER_STEPS}"]})
    cluster = LocalCluster(spec)
    try:
        cluster.start(timeout_s=60)
        yield cluster, sink
    finally:
        cluster.stop()
        sink.stop()
        if old is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = old


async def _request(cluster: LocalCluster, traceparent: str, moves) -> tuple[float, dict]:
    """Stream one completion; ``moves(request_id)`` runs once the first
    token is in. Returns the client's latency (ms) and the final ``ferry``."""
    final: dict = {}
    mover = None
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        await http.get("/v1/models")  # the connection is up before the clock starts
        t0 = time.perf_counter()
        async with http.stream("POST", "/v1/completions", headers={"traceparent": traceparent},
                               json={"prompt": "trace me", "max_tokens": 150, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    import json

                    chunk = json.loads(line[6:])
                    final = chunk.get("ferry") or final
                    if mover is None:
                        mover = asyncio.create_task(moves(chunk["id"]))
        latency_ms = (time.perf_counter() - t0) * 1000
    await mover
    return latency_ms, final


def test_one_trace_across_two_migrations_and_a_resume(traced):
    cluster, sink = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    path: list[str] = []

    async def moves(request_id: str) -> None:
        a = await asyncio.to_thread(find_instance_of, cluster, request_id)
        c = cluster.child("instance-2")
        b = next(i for i in cluster.instances() if i is not a and i is not c)
        assert (await migrate(cluster, request_id, b)).committed == 1
        assert (await migrate(cluster, request_id, c)).committed == 1
        path.extend([a.name, b.name, c.name])

    latency_ms, final = asyncio.run(_request(cluster, f"00-{trace_id}-{client_span}-01", moves))
    a, b, c = path
    assert final["migrations"] == 2 and final["resumes"] == 1, final
    assert final["instances"][:3] == [a, b, c] and final["instances"][3] in (a, b), final

    def complete(spans):
        mine = [s for s in spans if s.trace_id == trace_id]
        return (any(s.parent_id == client_span for s in mine)  # the frontend's request span, ended
                and sum(s.name == "ferry.migration" for s in mine) == 2
                and any(s.name == "ferry.decode" and s.instance == c for s in mine))  # C flushed at exit
    sink.wait(complete, timeout_s=30)
    time.sleep(0.5)  # stragglers of the same batch
    spans = sink.spans(trace_id)
    by_id = {s.span_id: s for s in spans}

    # One trace, under the client's span, every parent in it.
    root = next(s for s in spans if s.parent_id == client_span)
    assert root.service == "ferry-frontend" and root.name == "POST /v1/completions"
    orphans = [s.name for s in spans if s is not root and s.parent_id not in by_id]
    assert orphans == []
    assert {s.service for s in spans} == {"ferry-frontend", "ferry-scheduler", "ferry-instance"}
    assert {s.instance for s in spans if s.service == "ferry-instance"} == {a, b, c}

    # The frontend: dispatch, generate at A, attach at B, attach at C (fails), dispatch again, resume.
    segments = sorted((s for s in spans if s.parent_id == root.span_id and s.service == "ferry-frontend"),
                      key=lambda s: s.start_ns)
    assert [s.name for s in segments] == ["ferry.dispatch", "ferry.generate", "ferry.attach", "ferry.attach",
                                          "ferry.dispatch", "ferry.resume"]
    assert segments[3].error and not segments[5].error
    assert segments[5].attributes["ferry.resumed_tokens"] > 0
    # ... each dispatch decided by the scheduler, in a span that names the choice, under the request's.
    decided = [s for s in spans if s.name == "ferry.scheduler.dispatch"]
    assert [by_id[s.parent_id] for s in decided] == [root, root]
    assert [s.attributes["ferry.choice"] for s in sorted(decided, key=lambda s: s.start_ns)] == [a, final["instances"][3]]
    assert sorted(decided, key=lambda s: s.start_ns)[1].attributes["ferry.excluded"] == [c]

    # Each migration: under the request's span at its source, its stages and downtime inside, the
    # destination's side of it (pre-allocate, transfer, commit) as its children.
    migrations = sorted((s for s in spans if s.name == "ferry.migration"), key=lambda s: s.start_ns)
    assert [(m.instance, m.attributes["ferry.destination"], m.attributes["ferry.outcome"]) for m in migrations] \
        == [(a, b, "committed"), (b, c, "committed")]
    for m, dest in zip(migrations, (b, c)):
        children = [s for s in spans if s.parent_id == m.span_id]
        names = {s.name for s in children}
        assert {"ferry.migration.suspend", "ferry.migration.commit", "ferry.migration.downtime"} <= names, names
        assert any(s.name == "ferry.v1.Instance/Commit" and s.instance == dest for s in children)
    # A's migration hangs under the frontend's call to A, B's under the commit that brought the
    # request to B (its trace went with it).
    assert by_id[migrations[0].parent_id] is segments[1]
    assert by_id[migrations[1].parent_id].name == "ferry.v1.Instance/Commit"
    assert by_id[migrations[1].parent_id].instance == b
    # The request's phases at A, under the call to A; its decoding at B and at C after each commit.
    at_a = {s.name for s in spans if s.parent_id == segments[1].span_id and s.instance == a}
    assert {"ferry.queue", "ferry.prefill", "ferry.decode"} <= at_a
    for dest in (b, c):
        (decode,) = [s for s in spans if s.name == "ferry.decode" and s.instance == dest]
        assert by_id[decode.parent_id].name == "ferry.v1.Instance/Commit" and by_id[decode.parent_id].instance == dest

    # The timeline adds up: the frontend's segments, one after the other, fill its request's span
    # but for small gaps, and that span is the client's latency.
    edges = [root.start_ns, *[t for s in segments for t in (s.start_ns, s.end_ns)], root.end_ns]
    gaps = [(edges[i + 1] - edges[i]) / 1e6 for i in range(0, len(edges), 2)]
    covered = sum(s.ms for s in segments)
    print(f"client {latency_ms:.2f} ms, request span {root.ms:.2f} ms, segments {covered:.2f} ms, "
          f"gaps {[round(g, 2) for g in gaps]}")
    assert all(g >= 0 for g in gaps), gaps  # one after the other, inside the request's span
    assert max(gaps) < GAP_MS and root.ms - covered < UNCOVERED_MS, gaps
    assert 0 <= latency_ms - root.ms < CLIENT_SLACK_MS, (root.ms, latency_ms)


def test_an_untraced_request_leaves_no_trace_behind_a_sampled_one(traced):
    """The client's sampled=0 flag is honoured: nothing is recorded for it."""
    cluster, sink = traced
    trace_id = secrets.token_hex(16)
    r = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "quiet", "max_tokens": 4},
                   headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-00"}, timeout=30)
    assert r.status_code == 200
    time.sleep(0.5)
    assert sink.spans(trace_id) == []
