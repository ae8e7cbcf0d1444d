"""While the meta store is down, the cluster view asks the instances
themselves (libs/common/direct_status.py): a dead one stops being a
dispatch target, a live one keeps a fresh status."""

import asyncio

import grpc

from libs.pb import common_pb2 as cpb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.pb import meta_store_pb2 as pb
from libs.pb import meta_store_pb2_grpc as pb_grpc
from libs.common.cluster_view import ClusterView
from tests.common.test_cluster_view import start_store


class StatusOnly(ipb_grpc.InstanceServicer):
    def __init__(self, iid: str):
        self.iid, self.freeness = iid, 1.0

    async def GetStatus(self, request, context):
        return cpb.InstanceStatus(instance_id=self.iid, seq=99, freeness=self.freeness, total_blocks=64)


async def start_instance(iid: str):
    server = grpc.aio.server()
    servicer = StatusOnly(iid)
    ipb_grpc.add_InstanceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, f"127.0.0.1:{port}"


async def test_a_dead_instance_leaves_the_view_during_a_meta_store_outage():
    address, stop, task = await start_store()
    live, live_svc, live_addr = await start_instance("live")
    dead, _, dead_addr = await start_instance("dead")
    async with grpc.aio.insecure_channel(address) as ch:
        store = pb_grpc.MetaStoreStub(ch)
        for iid, addr in (("live", live_addr), ("dead", dead_addr)):
            await store.Register(pb.RegisterRequest(info=cpb.InstanceInfo(instance_id=iid, address=addr,
                                                                          block_size=16, total_blocks=64)))
            await store.ReportStatus(cpb.InstanceStatus(instance_id=iid, seq=1, freeness=1.0))
    view = ClusterView(address, outage_ttl_s=0.5)
    view.start()
    await asyncio.wait_for(view.synced.wait(), 5)
    for _ in range(200):
        if len(view.views()) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(v.instance_id for v in view.views()) == ["dead", "live"]
    stop.set()
    await task
    await dead.stop(0)
    live_svc.freeness = 42.0
    for _ in range(300):
        ids = sorted(v.instance_id for v in view.views())
        if ids == ["live"]:
            break
        await asyncio.sleep(0.01)
    assert ids == ["live"]
    assert view.views()[0].status.freeness == 42.0  # asked directly
    await view.stop()
    await live.stop(0)
