"""One bad request never stops the cluster (fake engines, real processes):
token ids outside the vocabulary are a 400 at the frontend and
INVALID_ARGUMENT at an instance; a request that makes the engine raise fails
alone (after one retry elsewhere) while the others get exactly their
tokens; an instance whose engine
thread dies leaves (exit code 3, deregistered) and its requests finish
elsewhere exactly once; a request an instance lost is found by the stall
watchdog and resumed elsewhere."""

import asyncio
import time

import grpc
import httpx
import pytest

from ferry.cluster import free_port
from libs.pb import common_pb2 as cpb
from libs.pb import frontend_pb2 as fpb
from libs.pb import frontend_pb2_grpc as fpb_grpc
from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text, stream_completion, wait_idle_and_check

POISON = 7  # the failpoint engine.poison_token makes a step raise on it, naming nobody


def assert_openai_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for n in needles:
        assert n in err["message"], err
    return err


def normal_requests_answered(url: str, n: int) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        for i in range(n):
            prompt = f"Hello there {i}"
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected_fake_text(prompt, 3)


@pytest.mark.parametrize("prompt,bad", [([99999999], "99999999"), ([-1378239111136], "-1378239111136"),
                                        ([104, 105, 1 << 24], "16777216")])
def test_out_of_vocabulary_ids_are_a_400_and_the_cluster_goes_on(fake_cluster, prompt, bad):
    r = httpx.post(f"{fake_cluster.url}/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 3})
    err = assert_openai_error(r, 400, f"token id {bad}", "vocabulary")
    assert err["param"] == "prompt" and err["type"] == "invalid_request_error"
    normal_requests_answered(fake_cluster.url, 20)
    for inst in fake_cluster.instances():
        assert inst.alive()
        rep = wait_idle_and_check(inst.address)
        assert rep.ok and rep.free_blocks == rep.total_blocks, rep


def test_logit_bias_is_refused_not_ignored(fake_cluster):
    r = httpx.post(f"{fake_cluster.url}/v1/completions",
                   json={"prompt": "x", "max_tokens": 2, "logit_bias": {"99999999": 5}})
    assert_openai_error(r, 400, "logit_bias")


def test_an_instance_refuses_out_of_vocabulary_ids_itself(fake_cluster):
    inst = fake_cluster.instances()[0]
    with grpc.insecure_channel(inst.address) as ch:
        stub = ipb_grpc.InstanceStub(ch)
        for prompt, stop in (([97, -5], []), ([97, 1 << 24], []), ([97], [1 << 30])):
            req = ipb.GenerateRequest(request_id=f"bad-{prompt[-1]}-{stop}", prompt_token_ids=prompt,
                                      sampling=cpb.SamplingParams(max_tokens=3, stop_token_ids=stop))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "outside the model's vocabulary" in e.value.details()
    assert inst.alive()


@pytest.fixture(scope="module")
def poison_cluster(tmp_path_factory):
    grpc_port = free_port()
    c = start_fake_cluster(tmp_path_factory, "poison", instances=2, grpc_port=grpc_port,
                           instance_args=["--token-delay-ms", "5", "--failpoints", f"engine.poison_token={POISON}"])
    c.grpc_port = grpc_port
    yield c
    c.stop()


async def test_a_request_that_breaks_a_batched_step_fails_alone(poison_cluster):
    prompts = [f"neighbour number {i} " * 2 for i in range(6)]
    async with httpx.AsyncClient(base_url=poison_cluster.url, timeout=60) as http:
        normal = [asyncio.create_task(stream_completion(http, {"prompt": p, "max_tokens": 40})) for p in prompts]
        await asyncio.sleep(0.1)  # they are decoding when the bad one joins a batch
        bad_stream = await http.post("/v1/completions", json={"prompt": [104, POISON, 105], "max_tokens": 5,
                                                              "stream": True})
        bad_plain = await http.post("/v1/completions", json={"prompt": [POISON, 104], "max_tokens": 5})
        results = await asyncio.gather(*normal)
    assert [t for t, _ in results] == [expected_fake_text(p, 40) for p in prompts]
    err = assert_openai_error(bad_plain, 500, "failed on instance", "poison_token")
    assert err["code"] == "internal"
    # It failed before its first token: the stream never started, so it is a
    # plain HTTP error, not a 200 with an error event.
    assert_openai_error(bad_stream, 500, "failed on instance", "poison_token")
    metrics = (await asyncio.to_thread(httpx.get, f"{poison_cluster.url}/metrics")).text
    # each failed once on each instance: resumed elsewhere once (its retry budget), then it failed alone
    assert 'ferry_request_errors_total{code="internal"} 4.0' in metrics
    for inst in poison_cluster.instances():
        assert inst.alive()
        rep = await asyncio.to_thread(wait_idle_and_check, inst.address)
        assert rep.ok and rep.free_blocks == rep.total_blocks, rep


def test_grpc_api_refuses_bad_ids_and_reports_failed_requests(poison_cluster):
    with grpc.insecure_channel(f"127.0.0.1:{poison_cluster.grpc_port}") as ch:
        stub = fpb_grpc.FrontendStub(ch)
        for ids in ([97, -1], [97, 1 << 24]):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(fpb.TextGenerateRequest(prompt_token_ids=ids,
                                                           sampling=cpb.SamplingParams(max_tokens=2)), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(fpb.TextGenerateRequest(prompt_token_ids=[97, POISON],
                                                       sampling=cpb.SamplingParams(max_tokens=2)), timeout=10))
        assert e.value.code() == grpc.StatusCode.INTERNAL and "poison_token" in e.value.details()
        ok = list(stub.Generate(fpb.TextGenerateRequest(prompt="fine", sampling=cpb.SamplingParams(max_tokens=4)),
                                timeout=10))
        assert "".join(m.text for m in ok) == expected_fake_text("fine", 4)


async def test_an_instance_whose_engine_dies_leaves_and_its_requests_finish_elsewhere(tmp_path_factory):
    c = start_fake_cluster(tmp_path_factory, "engine-dies", instances=2, dispatch="round_robin",
                           instance_args=["--token-delay-ms", "10"],
                           per_instance_args={0: ["--failpoints", "engine.die_after_steps=25"]})
    try:
        prompts = [f"survivor {i} " * 3 for i in range(8)]
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            results = await asyncio.wait_for(asyncio.gather(
                *[stream_completion(http, {"prompt": p, "max_tokens": 60}) for p in prompts]), 60)
            # exactly once, in order: each text is the whole expected text, nothing repeated
            assert [t for t, _ in results] == [expected_fake_text(p, 60) for p in prompts]
            assert sum(f["resumes"] for _, f in results) >= 1, [f for _, f in results]  # some ran on the dying one
            dead = c.child("instance-0")
            await asyncio.to_thread(dead.proc.wait, 10)
            assert dead.proc.returncode == 3
            async with grpc.aio.insecure_channel(c.scheduler) as ch:
                view = await spb_grpc.SchedulerStub(ch).GetClusterView(spb.ClusterViewRequest(), timeout=5)
            assert [r.info.instance_id for r in view.instances] == ["instance-1"]
            normal_after = await asyncio.gather(*[stream_completion(http, {"prompt": p, "max_tokens": 5})
                                                  for p in prompts[:4]])
            assert [t for t, _ in normal_after] == [expected_fake_text(p, 5) for p in prompts[:4]]
        rep = await asyncio.to_thread(wait_idle_and_check, c.child("instance-1").address)
        assert rep.ok and rep.free_blocks == rep.total_blocks, rep
    finally:
        c.stop()


async def test_a_lost_request_is_found_by_the_stall_watchdog_and_resumed(tmp_path_factory):
    c = start_fake_cluster(tmp_path_factory, "stall", instances=2, frontend_args=["--stall-timeout-s", "1"],
                           instance_args=["--token-delay-ms", "5"],
                           per_instance_args={0: ["--failpoints", "instance.lose_requests"]})
    try:
        prompts = [f"lost {i}" for i in range(3)]
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            results = await asyncio.wait_for(asyncio.gather(
                *[stream_completion(http, {"prompt": p, "max_tokens": 8}) for p in prompts]), 30)
        assert [t for t, _ in results] == [expected_fake_text(p, 8) for p in prompts]
        lost = [f for _, f in results if f["instances"][0] == "instance-0"]
        assert lost and all(f["resumes"] == 1 and f["instances"][-1] == "instance-1" for f in lost)
        assert time.monotonic() - t0 < 20
        metrics = (await asyncio.to_thread(httpx.get, f"{c.url}/metrics")).text
        stalled = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("ferry_stalled_requests_total "))
        assert stalled == len(lost)
        for inst in c.instances():
            rep = await asyncio.to_thread(wait_idle_and_check, inst.address)
            assert rep.ok and rep.free_blocks == rep.total_blocks, rep
    finally:
        c.stop()
