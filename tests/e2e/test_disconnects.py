"""Work nobody waits for stops (issue 39): a client that goes away at any
point, streaming or not, aborts its request at its instance and frees its
blocks: before the response of a non-streaming request, before the first
token of a stream (queued behind others), and mid-stream."""

import asyncio
import time

import grpc
import httpx
import pytest

from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text, stream_completion, wait_idle_and_check


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # One instance that runs one request at a time: a second one waits in its queue.
    c = start_fake_cluster(tmp_path_factory, "disconnects", instances=1,
                           instance_args=["--token-delay-ms", "10", "--max-num-seqs", "1"])
    yield c
    c.stop()


async def held(cluster) -> list:
    async with grpc.aio.insecure_channel(cluster.instances()[0].address) as ch:
        st = await ipb_grpc.InstanceStub(ch).GetStatus(ipb.GetStatusRequest(), timeout=5)
    return [(r.request_id, r.state) for r in st.requests]


async def until(pred, timeout_s: float = 15.0):  # a liveness wait: generous for a loaded machine
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if await pred():
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_a_non_streaming_client_that_leaves_aborts_its_request(cluster):
    async with httpx.AsyncClient(base_url=cluster.url) as http:
        with pytest.raises(httpx.ReadTimeout):  # 1,000 tokens take 10 s; the client gives up after 0.5 s
            await http.post("/v1/completions", json={"prompt": "long", "max_tokens": 1000}, timeout=0.5)

    async def gone():
        return not await held(cluster)
    print(f"aborted {await until(gone):.2f}s after the client left")
    rep = await asyncio.to_thread(wait_idle_and_check, cluster.instances()[0].address)
    assert rep.ok and rep.free_blocks == rep.total_blocks, rep


async def test_a_stream_that_leaves_before_its_first_token_aborts_its_request(cluster):
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        runner = asyncio.create_task(stream_completion(http, {"prompt": "first", "max_tokens": 150}))

        async def running():
            return len(await held(cluster)) == 1
        await until(running)
        first_id = (await held(cluster))[0][0]
        with pytest.raises(httpx.ReadTimeout):  # queued behind "first": no token, no response yet
            async with httpx.AsyncClient(base_url=cluster.url) as other:
                await other.post("/v1/completions", json={"prompt": "queued", "max_tokens": 5, "stream": True},
                                 timeout=0.4)

        async def only_first_left():
            return [rid for rid, _ in await held(cluster)] == [first_id]
        await until(only_first_left)  # the queued one left the instance's queue ...
        assert not runner.done()  # ... while "first" still runs (not because it ran after it)
        text, _ = await runner
    assert text == expected_fake_text("first", 150)
    rep = await asyncio.to_thread(wait_idle_and_check, cluster.instances()[0].address)
    assert rep.ok and rep.free_blocks == rep.total_blocks, rep


async def test_a_stream_that_leaves_mid_way_aborts_its_request(cluster):
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions",
                               json={"prompt": "mid", "max_tokens": 1000, "stream": True}) as r:
            async for _ in r.aiter_lines():
                break  # one event, then the client goes away

    async def gone():
        return not await held(cluster)
    await until(gone)
    rep = await asyncio.to_thread(wait_idle_and_check, cluster.instances()[0].address)
    assert rep.ok and rep.free_blocks == rep.total_blocks, rep
