"""The scheduler's prefix index equals what every instance's prefix cache
holds, after a run, after the scheduler restarts (rebuilt from snapshots)
and after the meta store restarts (real processes, fake engines)."""

from __future__ import annotations

import asyncio

import grpc
import httpx

from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from tests.conftest import start_fake_cluster
from tests.e2e.test_faults import wait_for
from tests.helpers import expected_fake_text, stream_completion

SYSTEM = ["you are a helpful assistant. " * 3, "answer in french, please, always. " * 3]


async def caches(c) -> dict[str, set[int]]:
    out = {}
    for inst in c.instances():
        async with grpc.aio.insecure_channel(inst.address) as ch:
            r = await ipb_grpc.InstanceStub(ch).CheckIntegrity(ipb.CheckIntegrityRequest(with_cached_hashes=True),
                                                               timeout=5)
        assert r.ok, r.error
        out[inst.name] = set(r.cached_block_hashes)
    return out


async def index(c) -> dict[str, set[int]]:
    async with grpc.aio.insecure_channel(c.scheduler) as ch:
        r = await spb_grpc.SchedulerStub(ch).GetPrefixIndex(spb.PrefixIndexRequest(with_hashes=True), timeout=5)
    return {i.instance_id: set(i.block_hashes) for i in r.instances if i.synced}


async def index_matches(c) -> bool:
    want = await caches(c)
    return await index(c) == want and any(want.values())


async def load(http, tag: str, n: int = 12) -> None:
    prompts = [SYSTEM[i % 2] + f"{tag} question {i} " * 2 for i in range(n)]
    res = await asyncio.gather(*(stream_completion(http, {"prompt": p, "max_tokens": 20}) for p in prompts))
    assert [t for t, _ in res] == [expected_fake_text(p, 20) for p in prompts]


async def test_index_equals_the_caches_through_restarts(tmp_path_factory):
    # 40 blocks each: the run evicts, so removals are exercised too
    c = start_fake_cluster(tmp_path_factory, "prefix-index", instances=2,
                           instance_args=["--token-delay-ms", "5", "--num-blocks", "40"])
    try:
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            await load(http, "first")
            assert await wait_for(lambda: index_matches(c), timeout=10)

            await asyncio.to_thread(c.kill, "scheduler")
            await load(http, "bypass")  # the caches change while no scheduler watches
            await asyncio.to_thread(c.restart, "scheduler")
            assert await wait_for(lambda: index_matches(c), timeout=20)

            await asyncio.to_thread(c.kill, "meta-store")
            await load(http, "no-meta")
            await asyncio.to_thread(c.restart, "meta-store")
            await load(http, "after")
            assert await wait_for(lambda: index_matches(c), timeout=20)
    finally:
        c.stop()
