"""Only the priority-aware policy (llumnix) runs a high-priority request at
high priority on the instance; the baselines and llumnix_base treat every
request alike, as in the paper's comparison, so instance headroom and the
waiting-queue order cannot favour high priority under them."""

import asyncio

import grpc
import pytest

from libs.pb import common_pb2 as cpb
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from tests.conftest import start_fake_cluster


@pytest.mark.parametrize("policy, expected", [("llumnix", cpb.PRIORITY_HIGH), ("llumnix_base", cpb.PRIORITY_NORMAL),
                                              ("infaas++", cpb.PRIORITY_NORMAL),
                                              ("round_robin", cpb.PRIORITY_NORMAL)])
async def test_run_priority_follows_the_policy(tmp_path_factory, policy, expected):
    c = start_fake_cluster(tmp_path_factory, "prio", instances=1, dispatch=policy)
    try:
        async with grpc.aio.insecure_channel(c.scheduler) as ch:
            stub = spb_grpc.SchedulerStub(ch)
            # NOTE: the scheduler is healthy before its first cluster view
            # arrives (it answers UNAVAILABLE until then; on a loaded machine
            # that is after start() returns).
            for _ in range(200):
                try:
                    high = await stub.Dispatch(spb.DispatchRequest(request_id="h", num_prompt_tokens=8,
                                                                   priority=cpb.PRIORITY_HIGH), timeout=10)
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE or "no cluster view yet" not in (e.details() or ""):
                        raise
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("the scheduler had no cluster view after 10 s")
            normal = await stub.Dispatch(spb.DispatchRequest(request_id="n", num_prompt_tokens=8,
                                                             priority=cpb.PRIORITY_NORMAL), timeout=10)
        assert high.policy == policy and high.instance_id == "instance-0"
        assert high.run_priority == expected
        assert normal.run_priority == cpb.PRIORITY_NORMAL
    finally:
        c.stop()
