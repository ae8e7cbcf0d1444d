"""KunServe with real processes (native SmolLM2): a member of a buddy group is
killed while both members serve pipelined requests. The group dissolves the
only way it can, since the survivor's dropped layers now have no holder: the
survivor's engine breaks and it stops. Every request resumes on the instance
outside the group by recompute (docs/design.md §7), and each client gets its whole
answer, exactly the text of an undisturbed run."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from ferry.cluster import ClusterSpec, LocalCluster, free_port
from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from tests.helpers import find_instance_of, stream_completion

pytestmark = pytest.mark.model

PROMPTS = [f"Write a short note number {i} about rivers and the sea." for i in range(4)]
BODY = {"max_tokens": 48, "min_tokens": 48, "temperature": 0}


async def _form_group(a: str, b: str, layers: int = 30) -> None:
    """Instance a keeps the first half of the layers, b the second; both drop first, then enter."""
    half = layers // 2
    keep = {a: ipb.LayerRange(start=0, stop=half), b: ipb.LayerRange(start=half, stop=layers)}
    drop = {a: ipb.LayerRange(start=half, stop=layers), b: ipb.LayerRange(start=0, stop=half)}
    for addr in (a, b):
        async with grpc.aio.insecure_channel(addr) as ch:
            await ipb_grpc.InstanceStub(ch).DropLayers(ipb.DropLayersRequest(layers=drop[addr], hold=True))
    for addr, other in ((a, b), (b, a)):
        async with grpc.aio.insecure_channel(addr) as ch:
            await ipb_grpc.InstanceStub(ch).SetPipeline(ipb.SetPipelineRequest(
                own=keep[addr], peers=[ipb.PipelinePeer(layers=keep[other], address=other)]))


async def test_a_member_killed_inside_a_buddy_group_loses_no_request(tmp_path_factory):
    spec = ClusterSpec(instances=3, engine="native", model="smollm2", port=free_port(), dispatch="round_robin",
                       instance_args=["--num-blocks", "96", "--torch-threads", "1", "--dtype", "float32"],
                       scheduler_args=["--no-migration"], log_dir=str(tmp_path_factory.mktemp("kunserve-kill")),
                       # Two instances die one after the other here (the killed member, then the survivor whose
                       # dropped layers have no holder): a request may meet both. The default retry budget (one
                       # resume) would then fail it alone, by design; this test is about losing none.
                       frontend_args=["--max-resumes", "2"])
    c = LocalCluster(spec)
    c.start(timeout_s=180)
    try:
        async with httpx.AsyncClient(base_url=c.url, timeout=120) as http:
            # Undisturbed answers first (greedy: the same text wherever and however it runs).
            want = [t for t, _ in await asyncio.gather(*(stream_completion(http, {**BODY, "prompt": p})
                                                         for p in PROMPTS))]
            a, b, outside = c.instances()
            await _form_group(a.address, b.address)
            killed = []
            # One stream at a time looks and kills: two streams that both passed the check
            # before either killed would each kill b (seen once in CI).
            one = asyncio.Lock()

            async def kill_b(text, rid):
                if len(text) < 20 or killed:
                    return
                async with one:
                    if killed:
                        return
                    holder = await asyncio.to_thread(find_instance_of, c, rid)
                    if holder is not None and holder.name == b.name:
                        killed.append(b.name)
                        await asyncio.to_thread(c.kill, b.name)

            results = await asyncio.gather(*(stream_completion(http, {**BODY, "prompt": p}, kill_b)
                                             for p in PROMPTS))
        assert killed == [b.name]
        assert [t for t, _ in results] == want
        finals = [f for _, f in results]
        moved = [f for f in finals if f["resumes"]]
        assert moved, finals  # the group's requests resumed ...
        assert all(f["instances"][-1] == outside.name for f in moved)  # ... outside the group
        assert not a.alive() or all(f["instances"][-1] != a.name for f in moved)
    finally:
        c.stop()
