"""Live migration between real instance processes (fake engine, whose tokens
are computed from what it reads back from its KV cache, so a broken transfer
changes the output). The client's stream must see exactly the tokens of an
unmigrated run; both block pools must be intact afterwards."""

import random

import httpx
import pytest

from tests.conftest import start_fake_cluster
from tests.helpers import (
    expected_fake_text,
    migrate,
    running_request_ids,
    stream_completion,
    wait_idle_and_check,
)

ARGS = ["--token-delay-ms", "8", "--num-blocks", "512", "--migration-last-stage-max-blocks", "1"]


def assert_clean(cluster):
    for inst in cluster.instances():
        if inst.alive():
            r = wait_idle_and_check(inst.address, timeout_s=8)
            assert r.ok, r.error
            assert r.num_requests == 0 and r.num_reservations == 0
            assert r.free_blocks == r.total_blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_fake_cluster(tmp_path_factory, "migration", instances=3, instance_args=ARGS,
                           dispatch="round_robin")
    yield c
    c.stop()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_tokens_exact_across_1_to_3_migrations_at_random_points(cluster, seed):
    rng = random.Random(seed)
    n_migrations = seed  # 1, 2, 3
    prompt = f"migration {seed} " * rng.randint(2, 12)
    n = 120
    points = sorted(rng.sample(range(5, n - 20), n_migrations))
    done = []

    async def on_chunk(text, rid):
        if points and len(text) >= points[0]:
            points.pop(0)
            reply = await migrate(cluster, rid)
            done.append(reply)

    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        text, final = await stream_completion(http, {"prompt": prompt, "max_tokens": n}, on_chunk)
    assert text == expected_fake_text(prompt, n)
    assert [r.committed for r in done] == [1] * n_migrations, done
    assert final["migrations"] == n_migrations
    assert len(set(final["instances"])) >= 2
    for r in done:
        res = r.results[0]
        assert res.stages >= 1 and res.blocks >= 1 and res.bytes == res.blocks * 16 * 2 * 4
    assert_clean(cluster)


async def test_many_concurrent_requests_migrating(cluster):
    """Several requests migrate while others decode beside them."""
    import asyncio

    async def one(i, http):
        prompt = f"concurrent {i} " * 3
        moved = []

        async def on_chunk(text, rid):
            if len(text) in (20, 50) and len(moved) < 2:
                moved.append(await migrate(cluster, rid))

        text, final = await stream_completion(http, {"prompt": prompt, "max_tokens": 80}, on_chunk)
        return text == expected_fake_text(prompt, 80), sum(m.committed for m in moved if m)

    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        results = await asyncio.gather(*(one(i, http) for i in range(8)))
    assert all(ok for ok, _ in results)
    assert sum(c for _, c in results) >= 8  # most migrations committed (limits may refuse some)
    assert_clean(cluster)


@pytest.mark.parametrize("flush_ms", [0, 150])
async def test_flush_interval_sends_the_same_tokens_in_fewer_events(cluster, flush_ms):
    """A flush interval holds tokens after the first and sends them together;
    without one, every token is its own event."""
    import grpc

    from libs.pb import common_pb2 as cpb
    from libs.pb import instance_pb2 as ipb
    from libs.pb import instance_pb2_grpc as ipb_grpc
    from tests.helpers import expected_fake_tokens

    prompt, n = list(b"flush interval"), 60  # 60 steps of 8 ms: about 0.5 s
    inst = cluster.instances()[0]
    async with grpc.aio.insecure_channel(inst.address) as ch:
        call = ipb_grpc.InstanceStub(ch).Generate(ipb.GenerateRequest(
            request_id=f"flush-{flush_ms}", prompt_token_ids=prompt, flush_interval_ms=flush_ms,
            sampling=cpb.SamplingParams(max_tokens=n, ignore_eos=True)))
        events = [ev async for ev in call]
    tokens = [t for ev in events for t in ev.token_ids]
    assert tokens == expected_fake_tokens(prompt, n)
    starts = [ev.index for ev in events if ev.token_ids]
    sizes = [len(ev.token_ids) for ev in events if ev.token_ids]
    assert starts == [sum(sizes[:i]) for i in range(len(sizes))]  # contiguous, in order
    assert events[-1].finish_reason == "length"
    assert sizes[0] == 1  # the first token is never held
    if flush_ms == 0:
        assert sizes == [1] * n
    else:
        assert len(sizes) <= 1 + 0.5 / 0.15 + 2, sizes
    assert_clean(cluster)


async def test_non_streaming_request_migrates_with_held_tokens(cluster):
    """Non-streaming requests run with the frontend's flush interval (tokens
    held on the instance between sends): migrating one twice still gives the
    exact text, each token once."""
    import asyncio

    prompt, n = "held tokens " * 4, 200  # 200 steps of 8 ms
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        post = asyncio.create_task(http.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": False}))
        rid = None
        for _ in range(200):
            ids = await asyncio.to_thread(running_request_ids, cluster)
            if ids:
                rid = ids[0]
                break
            await asyncio.sleep(0.01)
        assert rid is not None
        moved = []
        for _ in range(2):
            await asyncio.sleep(0.35)
            moved.append(await migrate(cluster, rid))
        r = await post
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == expected_fake_text(prompt, n)
    assert body["usage"]["completion_tokens"] == n
    assert body["ferry"]["migrations"] == sum(m.committed for m in moved if m) >= 1
    assert_clean(cluster)
