"""Live prefix-aware dispatch (real processes, fake engines): a prompt whose
prefix one instance holds goes there under llumnix-prefix, through the
frontend (which sends the prompt's block hashes) and the scheduler (which
looks them up in its prefix index). Prefix-blind llumnix, on the same two
idle instances, sends it to the lower id, which then computes the prompt.
With the scheduler killed, the frontend's bypass runs the same policy with
its own prefix index (followed since the first reply named a prefix-aware
policy), and places the next such prompt the same way."""

from __future__ import annotations

import grpc
import httpx
import pytest

from libs.pb import common_pb2 as cpb
from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from libs.common.prefix_hash import block_hashes
from tests.conftest import start_fake_cluster
from tests.e2e.test_faults import wait_for
from tests.helpers import expected_fake_tokens, metric, stream_completion

PROMPT = [97 + (i * 7) % 26 for i in range(200)]  # token ids of the fake vocabulary
PROMPT2 = [97 + (i * 11) % 26 for i in range(200)]


async def warm(address: str, prompt: list[int], request_id: str) -> None:
    """The instance computes ``prompt`` (asked directly, not through the scheduler)."""
    async with grpc.aio.insecure_channel(address) as ch:
        call = ipb_grpc.InstanceStub(ch).Generate(ipb.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=cpb.SamplingParams(max_tokens=4),
            priority=cpb.PRIORITY_NORMAL))
        async for _ in call:
            pass


async def frontend_sees(http, prefix_instances: int) -> bool:
    """The frontend's view: both instances idle, and its prefix index
    following ``prefix_instances`` of them."""
    m = (await http.get("/metrics")).text
    loads = [metric(m, f"ferry_instance_{k}", True, instance=i) for i in ("instance-0", "instance-1")
             for k in ("running", "waiting")]
    return loads == [0, 0, 0, 0] and metric(m, "ferry_bypass_prefix_index_instances") == prefix_instances


async def cached(address: str) -> set[int]:
    async with grpc.aio.insecure_channel(address) as ch:
        r = await ipb_grpc.InstanceStub(ch).CheckIntegrity(ipb.CheckIntegrityRequest(with_cached_hashes=True),
                                                           timeout=5)
    assert r.ok, r.error
    return set(r.cached_block_hashes)


async def idle_in_view(scheduler: str) -> bool:
    """The scheduler's view shows every instance with nothing running or queued
    (no stale report of the warm-up request skews the load)."""
    async with grpc.aio.insecure_channel(scheduler) as ch:
        r = await spb_grpc.SchedulerStub(ch).GetClusterView(spb.ClusterViewRequest(), timeout=5)
    return len(r.instances) == 2 and all(i.HasField("status") and i.status.num_running == 0
                                         and i.status.num_waiting == 0 for i in r.instances)


async def indexed(scheduler: str, instance_id: str, hashes: set[int]) -> bool:
    async with grpc.aio.insecure_channel(scheduler) as ch:
        r = await spb_grpc.SchedulerStub(ch).GetPrefixIndex(spb.PrefixIndexRequest(with_hashes=True), timeout=5)
    return any(i.instance_id == instance_id and i.synced and hashes <= set(i.block_hashes) for i in r.instances)


@pytest.mark.parametrize("policy, expected", [("llumnix-prefix", "instance-1"), ("llumnix", "instance-0")])
async def test_a_repeated_prompt_goes_where_its_prefix_is(tmp_path_factory, policy, expected):
    c = start_fake_cluster(tmp_path_factory, f"prefix-dispatch-{policy}", instances=2, dispatch=policy,
                           instance_args=["--token-delay-ms", "2", "--num-blocks", "512", "--block-size", "16"])
    try:
        insts = {i.name: i for i in c.instances()}
        assert set(insts) == {"instance-0", "instance-1"}
        await warm(insts["instance-1"].address, PROMPT, "warm")  # instance-1 computes the prompt first
        prefix = set(block_hashes(PROMPT, 16))
        assert prefix <= await cached(insts["instance-1"].address)
        assert await wait_for(lambda: indexed(c.scheduler, "instance-1", prefix), timeout=20)
        assert await wait_for(lambda: idle_in_view(c.scheduler), timeout=20)
        assert not prefix & await cached(insts["instance-0"].address)

        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            text, _ = await stream_completion(http, {"prompt": PROMPT, "max_tokens": 8})
        assert text == bytes(expected_fake_tokens(PROMPT, 8)).decode()
        # the instance that served it named the prompt's blocks; the other did not see it
        other = "instance-0" if expected == "instance-1" else "instance-1"
        assert prefix <= await cached(insts[expected].address)
        if expected == "instance-1":
            assert not prefix & await cached(insts[other].address)

            # bypass: the scheduler is gone; the frontend places by its own prefix index
            c.kill("scheduler")
            await warm(insts["instance-1"].address, PROMPT2, "warm2")
            prefix2 = set(block_hashes(PROMPT2, 16))
            async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
                assert await wait_for(lambda: frontend_sees(http, 2), 20)
                text, _ = await stream_completion(http, {"prompt": PROMPT2, "max_tokens": 8})
                assert text == bytes(expected_fake_tokens(PROMPT2, 8)).decode()
                assert metric((await http.get("/metrics")).text, "ferry_bypass_dispatches_total") == 1
            assert prefix2 <= await cached(insts[expected].address)
            assert not prefix2 & await cached(insts[other].address)
    finally:
        c.stop()
