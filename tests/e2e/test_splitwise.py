"""Splitwise end to end: a real cluster with 1 prefill + 1 decode instance
(fake engine, whose tokens come from what it reads back from its KV cache,
so a broken handoff changes the text), the official openai client. Every
request prefills on instance-0 and decodes on instance-1; the client sees
exactly the tokens of a colocated run; a decode or prefill instance killed
mid-handoff loses no request."""

from __future__ import annotations

import asyncio
import pathlib

import grpc
import httpx
import openai
import pytest

from libs.pb import common_pb2 as cpb
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text, instance_status, stream_completion, wait_idle_and_check

ARGS = ["--token-delay-ms", "5", "--num-blocks", "512", "--migration-deadline-ms", "600"]
PD = {"instances": 2, "prefill": 1, "decode": 1}


def assert_clean(addresses):
    for a in addresses:
        r = wait_idle_and_check(a, timeout_s=8)
        assert r.ok, r.error
        assert r.num_requests == 0 and r.num_reservations == 0 and r.free_blocks == r.total_blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_fake_cluster(tmp_path_factory, "splitwise", instance_args=ARGS, **PD)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")


def test_roles_travel_in_the_status_to_the_scheduler(cluster):
    assert instance_status(cluster.child("instance-0").address).role == cpb.ROLE_PREFILL
    assert instance_status(cluster.child("instance-1").address).role == cpb.ROLE_DECODE
    with grpc.insecure_channel(cluster.scheduler) as ch:
        view = spb_grpc.SchedulerStub(ch).GetClusterView(spb.ClusterViewRequest(), timeout=5)
        placed = spb_grpc.SchedulerStub(ch).Dispatch(spb.DispatchRequest(request_id="d", num_prompt_tokens=40),
                                                     timeout=5)
    assert {r.info.instance_id: r.status.role for r in view.instances} == {
        "instance-0": cpb.ROLE_PREFILL, "instance-1": cpb.ROLE_DECODE}
    assert (placed.instance_id, placed.decode_instance_id) == ("instance-0", "instance-1")
    assert placed.decode_address == cluster.child("instance-1").address


def test_completion_prefills_on_one_instance_and_decodes_on_the_other(client, cluster):
    for prompt in ["Hello, Splitwise", "x" * 16, "a longer prompt " * 9]:
        r = client.completions.create(model="fake", prompt=prompt, max_tokens=24)
        assert r.choices[0].text == expected_fake_text(prompt, 24)
        assert r.usage.completion_tokens == 24
        ferry = r.model_extra["ferry"]
        assert ferry["instances"] == ["instance-0", "instance-1"] and ferry["migrations"] == 1, ferry
    assert_clean([i.address for i in cluster.instances()])


def test_streaming_chat_continues_across_the_handoff(client, cluster):
    msgs = [{"role": "user", "content": "tell me about phase splitting"}]
    full = client.chat.completions.create(model="fake", messages=msgs, max_tokens=30, temperature=0)
    text = full.choices[0].message.content
    assert len(text) == 30 and full.model_extra["ferry"]["instances"] == ["instance-0", "instance-1"]
    chunks = client.chat.completions.create(model="fake", messages=msgs, max_tokens=30, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


async def test_concurrent_requests_all_hand_off(cluster):
    prompts = [f"concurrent {i} " * (1 + i % 5) for i in range(12)]
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        results = await asyncio.gather(*(stream_completion(http, {"prompt": p, "max_tokens": 40}) for p in prompts))
    assert [t for t, _ in results] == [expected_fake_text(p, 40) for p in prompts]
    assert all(f["instances"] == ["instance-0", "instance-1"] for _, f in results)
    assert_clean([i.address for i in cluster.instances()])


def test_one_token_request_finishes_on_the_prefill_instance(client):
    r = client.completions.create(model="fake", prompt="just one", max_tokens=1)
    assert r.choices[0].text == expected_fake_text("just one", 1)
    assert r.model_extra["ferry"]["instances"] == ["instance-0"]


async def test_scheduler_down_the_bypass_places_both_steps(cluster):
    """NOTE: the last test on the module's cluster (its scheduler stays down).
    The frontend dispatches by itself and still hands requests off."""
    cluster.kill("scheduler")
    prompts = [f"bypass {i} " * 3 for i in range(4)]
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        results = await asyncio.gather(*(stream_completion(http, {"prompt": p, "max_tokens": 20}) for p in prompts))
        metrics = (await http.get("/metrics")).text
    assert [t for t, _ in results] == [expected_fake_text(p, 20) for p in prompts]
    assert all(f["instances"] == ["instance-0", "instance-1"] for _, f in results)
    assert "ferry_dispatch_bypass 1.0" in metrics
    assert_clean([i.address for i in cluster.instances()])


async def test_decode_instance_killed_mid_handoff(tmp_path_factory):
    """The decode instance dies with the KV half sent: the handoff aborts and
    the request decodes on the prefill instance, the client none the wiser."""
    c = start_fake_cluster(tmp_path_factory, "pd-dest-killed", instance_args=ARGS,
                           per_instance_args={1: ["--failpoints", "dest.crash_mid_transfer"]}, **PD)
    try:
        prompt = "killed decode " * 8
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            text, final = await stream_completion(http, {"prompt": prompt, "max_tokens": 60})
        assert text == expected_fake_text(prompt, 60)
        assert final["instances"] == ["instance-0"] and final["resumes"] == 0, final
        assert not c.child("instance-1").alive()
        assert_clean([c.child("instance-0").address])
    finally:
        c.stop()


async def test_prefill_instance_killed_mid_handoff(tmp_path_factory):
    """The prefill instance dies with the KV half sent: the frontend resumes
    the request by recompute on the instance left (the decode one, colocated);
    the decode instance's reservation runs out and frees its blocks."""
    c = start_fake_cluster(tmp_path_factory, "pd-source-killed", instance_args=ARGS,
                           per_instance_args={0: ["--failpoints", "source.crash_mid_transfer"]}, **PD)
    try:
        prompt = "killed prefill " * 8
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            text, final = await stream_completion(http, {"prompt": prompt, "max_tokens": 60})
        assert text == expected_fake_text(prompt, 60)
        assert final["resumes"] == 1 and final["instances"] == ["instance-0", "instance-1"], final
        assert not c.child("instance-0").alive()
        assert_clean([c.child("instance-1").address])
    finally:
        c.stop()


def set_role(cluster, instance_id: str, role: int) -> spb.SetInstanceRoleReply:
    with grpc.insecure_channel(cluster.scheduler) as ch:
        return spb_grpc.SchedulerStub(ch).SetRole(spb.SetInstanceRoleRequest(instance_id=instance_id, role=role),
                                                  timeout=10)


async def test_role_change_at_run_time_drains_by_migration(tmp_path_factory):
    """Two mixed instances; mid-stream the scheduler makes instance-0 a
    prefill instance: the requests decoding there move to instance-1 by live
    migration (no recompute, exact tokens), and new requests prefilled there
    hand off."""
    c = start_fake_cluster(tmp_path_factory, "pd-role-change", instances=2, dispatch="round_robin",
                           instance_args=ARGS)
    try:
        prompts = [f"role change {i} " * 4 for i in range(4)]
        changed = []

        async def on_chunk(text, rid):
            if len(text) >= 20 and not changed:
                changed.append(await asyncio.to_thread(set_role, c, "instance-0", cpb.ROLE_PREFILL))

        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            results = await asyncio.gather(
                stream_completion(http, {"prompt": prompts[0], "max_tokens": 250}, on_chunk),
                *(stream_completion(http, {"prompt": p, "max_tokens": 250}) for p in prompts[1:]))
            assert [t for t, _ in results] == [expected_fake_text(p, 250) for p in prompts]
            finals = [f for _, f in results]
            assert all(f["resumes"] == 0 for f in finals)
            started_on_0 = [f for f in finals if f["instances"][0] == "instance-0"]
            assert started_on_0 and all(f["instances"][-1] == "instance-1" for f in started_on_0), finals
            assert changed[0].previous == cpb.ROLE_MIXED and changed[0].draining >= 1
            assert instance_status(c.child("instance-0").address).role == cpb.ROLE_PREFILL
            # New requests: prefilled on instance-0 they hand off to instance-1.
            after = await asyncio.gather(*(stream_completion(http, {"prompt": f"after {i}", "max_tokens": 20})
                                           for i in range(4)))
        assert [t for t, _ in after] == [expected_fake_text(f"after {i}", 20) for i in range(4)]
        assert all(f["instances"] in (["instance-0", "instance-1"], ["instance-1"]) for _, f in after)
        assert any(f["instances"] == ["instance-0", "instance-1"] for _, f in after)
        # Nobody would decode: refused, clearly.
        with pytest.raises(grpc.RpcError) as e:
            set_role(c, "instance-1", cpb.ROLE_PREFILL)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no other instance decodes" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            set_role(c, "instance-9", cpb.ROLE_DECODE)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            set_role(c, "instance-0", 7)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown instance role" in e.value.details()
        assert set_role(c, "instance-0", cpb.ROLE_MIXED).previous == cpb.ROLE_PREFILL
        assert_clean([i.address for i in c.instances()])
    finally:
        c.stop()


async def test_long_prompts_hand_off_layer_by_layer(tmp_path_factory):
    """The prefill instance plans prompts of 64 tokens or more as per-layer
    handoffs (a 32-token budget: the prompt computes in several steps while
    its layers stream): the openai client gets the colocated text, streamed
    or not, and shorter prompts still hand off serialized."""
    args = ARGS + ["--handoff-per-layer-threshold", "64", "--max-num-batched-tokens", "32"]
    c = start_fake_cluster(tmp_path_factory, "pd-per-layer", instance_args=args, **PD)
    try:
        client = openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key="unused")
        long_prompts = [f"per-layer handoff {i} " * 6 for i in range(3)]  # 120+ tokens
        rs = await asyncio.gather(*(client.completions.create(model="fake", prompt=p, max_tokens=24)
                                    for p in long_prompts + ["short one"]))
        assert [r.choices[0].text for r in rs] == [expected_fake_text(p, 24) for p in long_prompts + ["short one"]]
        assert all(r.model_extra["ferry"]["instances"] == ["instance-0", "instance-1"] for r in rs)
        chunks = await client.completions.create(model="fake", prompt=long_prompts[0], max_tokens=40, stream=True)
        assert "".join([ch.choices[0].text async for ch in chunks]) == expected_fake_text(long_prompts[0], 40)
        log = await asyncio.to_thread(pathlib.Path(c.child("instance-0").log_path).read_text)
        per_layer = {ln.split("migration_id=")[1].split()[0] for ln in log.splitlines()
                     if "migration transition" in ln and "to=stream" in ln}
        assert len(per_layer) == 4 and all(m.startswith("hand-") for m in per_layer), per_layer
        assert "not available on this path" not in log
        assert_clean([i.address for i in c.instances()])
        await client.close()
    finally:
        c.stop()
