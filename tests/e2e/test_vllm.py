"""vLLM instances (SmolLM2 on CPU) behind the whole stack: the official
openai client, and live migration of running requests through the real
protocol (pre-copy stages while decoding, suspend, last stage, commit) with
exact greedy tokens and no leaked block, plus the aborts of each stage.

One cluster of three vLLM instances: 0 plain; 1 slow to send a stage (a
request can finish while its pre-copy is in flight); 2 loses its commit
replies (the request is suspended at the source, then resumed there from its
held blocks, and the destination drops its installed copy) and is small
(a long request does not fit: refused at its first pre-allocation).

The cluster is traced (spans over OTLP to a receiver in this test,
ferry/trace_sink.py): vLLM's own span of a request (``llm_request``) lands in
the request's trace, beside the instance's phases of the request."""

import asyncio
import os
import secrets
import time

import httpx
import openai
import pytest

from ferry.cluster import ClusterSpec, LocalCluster, free_port
from ferry.trace_sink import TraceSink
from services.instance.engine.vllm import available
from tests.helpers import instance_status, migrate, stream_completion, wait_idle_and_check

pytestmark = [pytest.mark.model, pytest.mark.slow,
              pytest.mark.skipif(available() is not None, reason=str(available()))]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ARGS = ["--max-num-seqs", "8", "--max-model-len", "1024", "--dtype", "float32",
        "--migration-last-stage-max-blocks", "1", "--vllm-args=--enforce-eager"]
STORY = "Write a short story about a ferry that carries travellers across a wide river."


@pytest.fixture(scope="module")
def sink():
    s = TraceSink().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, sink):
    old = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # the children's span processors (Ferry's, vLLM's) export every 0.1 s
    c = LocalCluster(ClusterSpec(
        instances=3, engine="vllm", port=free_port(), dispatch="round_robin", instance_args=ARGS,
        otlp_endpoint=sink.endpoint,
        per_instance_args={0: ["--num-blocks", "96"],
                           1: ["--num-blocks", "96", "--failpoints", "source.copy_delay_ms=3000"],
                           2: ["--num-blocks", "6", "--max-model-len", "192",
                              "--failpoints", "dest.drop_commit_reply"]},
        log_dir=str(tmp_path_factory.mktemp("vllm"))))
    try:
        c.start(timeout_s=480)
    finally:
        if old is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = old
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")


def assert_clean(cluster):
    for inst in cluster.instances():
        r = wait_idle_and_check(inst.address, timeout_s=20)
        assert r.ok, r.error
        assert (r.num_requests, r.num_reservations, r.free_blocks) == (0, 0, r.total_blocks), r


def test_openai_client_chat_and_streaming(client, cluster):
    for _ in range(3):  # round robin: every instance answers once
        r = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24)
        answer = r.choices[0].message.content
        assert "Paris" in answer
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer
    r = client.completions.create(model="smollm2", prompt="The ferry crossed", max_tokens=8, temperature=0.8,
                                  seed=3)
    again = client.completions.create(model="smollm2", prompt="The ferry crossed", max_tokens=8,
                                      temperature=0.8, seed=3)
    assert r.choices[0].text == again.choices[0].text  # a seed is served reproducibly
    status = instance_status(cluster.child("instance-0").address)
    assert status.total_blocks == 96 and status.block_size == 32
    assert_clean(cluster)


async def _migrated_run(cluster, http, body, dest_name, at_chunk):
    orders = []

    async def on_chunk(text, rid):
        if not orders and on_chunk.n >= at_chunk:
            orders.append(await migrate(cluster, rid, dest=cluster.child(dest_name)))
        on_chunk.n += 1
    on_chunk.n = 0
    text, final = await stream_completion(http, body, on_chunk)
    return text, final, orders[0] if orders else None


async def test_live_migration_exact_greedy_tokens(cluster):
    body = {"prompt": STORY, "max_tokens": 96, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
        reference, ref_final = await stream_completion(http, body)
        assert ref_final["migrations"] == 0
        await _dispatch_to(cluster, http, "instance-0")
        text, final, order = await _migrated_run(cluster, http, body, "instance-1", at_chunk=8)
    assert order is not None and order.committed == 1, order
    assert final["migrations"] == 1 and final["instances"][0] != "instance-1"
    assert "instance-1" in final["instances"]
    assert text == reference
    assert_clean(cluster)


async def _dispatch_to(cluster, http, name):
    """Send throwaway requests until round robin points at ``name`` next."""
    for _ in range(3):
        _, f = await stream_completion(http, {"prompt": "x", "max_tokens": 1})
        nxt = {"instance-0": "instance-1", "instance-1": "instance-2", "instance-2": "instance-0"}
        if nxt[f["instances"][0]] == name:
            return
    raise AssertionError("round robin did not come round")


async def test_commit_lost_resumes_at_source_from_held_blocks(cluster):
    """The destination installs the request and loses the commit reply: the
    source, already suspended (vLLM request aborted, blocks held), resumes it
    from its held blocks; the destination drops its copy. Same tokens."""
    body = {"prompt": STORY, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
        reference, _ = await stream_completion(http, body)
        await _dispatch_to(cluster, http, "instance-0")
        text, final, order = await _migrated_run(cluster, http, body, "instance-2", at_chunk=4)
    assert order is not None and order.aborted == 1, order
    assert "commit reply lost" in order.results[0].reason
    assert final["migrations"] == 0 and final["instances"] == ["instance-0"]
    assert text == reference
    assert_clean(cluster)


async def test_destination_refuses_a_request_that_does_not_fit(cluster):
    body = {"prompt": STORY * 10, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
        reference, _ = await stream_completion(http, body)
        await _dispatch_to(cluster, http, "instance-0")
        text, final, order = await _migrated_run(cluster, http, body, "instance-2", at_chunk=2)
    assert order is not None and order.aborted == 1 and "do not fit" in order.results[0].reason, order
    assert final["migrations"] == 0 and text == reference
    assert_clean(cluster)


async def test_request_finishing_during_a_precopy_stage_aborts_the_migration(cluster):
    """Instance-1 holds each stage 3 s after sending it; the request ends
    meanwhile: the verify after the stage finds it gone, the destination
    frees its reservation, the client has all its tokens."""
    body = {"prompt": STORY * 6, "max_tokens": 10, "ignore_eos": True, "temperature": 0}  # 2+ full blocks
    async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
        reference, _ = await stream_completion(http, body)
        await _dispatch_to(cluster, http, "instance-1")
        text, final, order = await _migrated_run(cluster, http, body, "instance-0", at_chunk=1)
    assert order is not None and order.aborted == 1 and "finished" in order.results[0].reason, order
    assert final["instances"] == ["instance-1"] and text == reference
    assert_clean(cluster)


async def test_migration_racing_the_end_of_a_request_is_clean(cluster):
    """Ordered two tokens before the end: the request may finish before the
    suspend (the migration aborts) or move in time; either way the client
    gets exactly its tokens and no block leaks."""
    body = {"prompt": STORY, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
        reference, _ = await stream_completion(http, body)
        await _dispatch_to(cluster, http, "instance-0")
        text, _, order = await _migrated_run(cluster, http, body, "instance-1", at_chunk=4)
    assert text == reference
    if order is not None:
        assert order.committed + order.aborted <= 1
    await asyncio.sleep(0.5)
    assert_clean(cluster)


def test_the_api_features_through_vllm(client):
    """logprobs, n, echo with max_tokens 0 and a json_schema, on vLLM's own
    sampler and structured-output backend (Ferry passes them on). Tools are not
    tried here: their system prompt (~170 tokens) does not fit this cluster's
    192-token context (instance-2's); tool_choice="required" reaches the same
    backend as a JSON schema."""
    import json

    import jsonschema

    r = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)  # greedy took the best
    n = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                  seed=3, n=2)
    assert sorted(c.index for c in n.choices) == [0, 1] and n.usage.completion_tokens == 16
    e = client.completions.create(model="smollm2", prompt="The capital of France is Paris.", max_tokens=0,
                                  echo=True, logprobs=1)
    lp = e.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    j = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=40,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "c", "schema": schema}})
    jsonschema.validate(json.loads(j.choices[0].message.content), schema)


def test_vllms_own_span_lands_in_the_requests_trace(cluster, sink):
    """The W3C trace context goes into vLLM (its ``trace_headers``): vLLM's
    span of the request is a child of the frontend's call to the instance
    (as the instance's own spans of it are), in the client's trace; a request the client does not sample leaves no span of
    vLLM's (nor a trace of its own)."""
    quiet = secrets.token_hex(16)
    for _ in range(3):  # round robin: one on each instance
        r = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "quiet", "max_tokens": 4},
                       headers={"traceparent": f"00-{quiet}-{secrets.token_hex(8)}-00"}, timeout=60)
        assert r.status_code == 200
    before = {s.span_id for s in sink.spans() if s.name == "llm_request"}
    trace_id = secrets.token_hex(16)
    r = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "trace me", "max_tokens": 6},
                   headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}, timeout=60)
    assert r.status_code == 200
    sink.wait(lambda spans: any(s.trace_id == trace_id and s.name == "llm_request" for s in spans), timeout_s=30)
    time.sleep(0.5)  # stragglers
    spans = sink.spans(trace_id)
    by_id = {s.span_id: s for s in spans}
    (llm,) = [s for s in spans if s.name == "llm_request"]
    # Under the frontend's call to the instance, beside the instance's own phases of the request.
    parent = by_id[llm.parent_id]
    assert parent.service == "ferry-frontend" and parent.name == "ferry.generate", parent
    (prefill,) = [s for s in spans if s.name == "ferry.prefill"]
    assert prefill.parent_id == parent.span_id and prefill.instance == r.json()["ferry"]["instances"][0]
    assert llm.attributes["gen_ai.usage.completion_tokens"] == 6
    assert llm.attributes["gen_ai.usage.prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert parent.start_ns <= llm.start_ns and llm.end_ns <= parent.end_ns + 5_000_000
    assert sink.spans(quiet) == []
    # Every span of vLLM's is in a trace Ferry started (none rooted by vLLM itself).
    ours = {s.span_id for s in sink.spans() if s.service.startswith("ferry-")}
    assert all(s.parent_id in ours for s in sink.spans() if s.name == "llm_request" and s.span_id not in before)


async def test_a_migrated_requests_vllm_span_lands_in_its_trace(cluster, sink):
    """A request that migrated into a vLLM instance gets vLLM's span of its
    incarnation there too (RequestState.trace_headers, from the
    destination's commit): in the request's trace, under a span of the
    destination's, its prompt the original one plus the tokens delivered
    before the move."""
    trace_id = secrets.token_hex(16)
    body = {"prompt": STORY, "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http, \
            httpx.AsyncClient(base_url=cluster.url, timeout=300,
                              headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}) as traced:
        prompt_tokens = (await http.post("/v1/completions", json={"prompt": STORY, "max_tokens": 1})
                         ).json()["usage"]["prompt_tokens"]
        await _dispatch_to(cluster, http, "instance-0")
        _, final, order = await _migrated_run(cluster, traced, body, "instance-1", at_chunk=8)
    assert order is not None and order.committed == 1, order
    assert final["instances"][-1] == "instance-1"

    def destination_span(spans):
        by_id = {s.span_id: s for s in spans}
        return [s for s in spans if s.name == "llm_request" and s.parent_id in by_id
                and by_id[s.parent_id].instance == "instance-1"]
    sink.wait(lambda spans: destination_span([s for s in spans if s.trace_id == trace_id]), timeout_s=30)
    time.sleep(0.5)  # stragglers
    spans = sink.spans(trace_id)
    (llm,) = destination_span(spans)
    # The source's incarnation ended by the move (an abort in vLLM): vLLM makes no span of it.
    assert [s for s in spans if s.name == "llm_request"] == [llm]
    # Its incarnation there: the prompt plus what was delivered before the move, then the rest.
    prompt, completion = llm.attributes["gen_ai.usage.prompt_tokens"], llm.attributes["gen_ai.usage.completion_tokens"]
    assert prompt_tokens + 8 <= prompt < prompt_tokens + 48
    assert prompt + completion == prompt_tokens + 48
    assert_clean(cluster)
