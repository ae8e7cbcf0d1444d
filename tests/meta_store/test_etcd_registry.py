"""Meta-store replicas on a real etcd (services/meta_store/etcd_registry.py),
over real gRPC on loopback: one cluster served by two replicas."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from libs.pb import common_pb2 as cpb
from libs.pb import meta_store_pb2 as pb
from libs.pb import meta_store_pb2_grpc as pb_grpc
from libs.common.server import serve
from services.meta_store.service import MetaStoreConfig, MetaStoreService
from tests.etcd_fixture import etcd_server  # noqa: F401 - a fixture

TTL = 1.0


class Replica:
    def __init__(self, endpoint: str, **kw):
        self.svc = MetaStoreService(MetaStoreConfig(port=0, ttl_s=TTL, etcd=endpoint, etcd_share_interval_s=0.05,
                                                    **kw))
        self.stop_event = asyncio.Event()
        self.address = ""
        self.task = None

    async def start(self) -> "Replica":
        ready = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(serve(self.svc, "127.0.0.1", 0, stop_event=self.stop_event,
                                              ready=ready.set_result))
        self.address = await asyncio.wait_for(ready, 10)
        await until(lambda: self.svc.registry.connected)
        return self

    async def stop(self) -> None:
        self.stop_event.set()
        await self.task

    @property
    def registry(self):
        return self.svc.registry


async def until(cond, timeout_s: float = 10.0, every_s: float = 0.02) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(every_s)


@pytest.fixture
async def replicas(etcd_server):  # noqa: F811
    a, b = Replica(etcd_server.endpoint), Replica(etcd_server.endpoint)
    await a.start()
    await b.start()
    await until(lambda: a.registry.peers and b.registry.peers)
    yield a, b
    for r in (a, b):
        if not r.stop_event.is_set():
            await r.stop()


def _info(i: str) -> cpb.InstanceInfo:
    return cpb.InstanceInfo(instance_id=i, address="127.0.0.1:1", engine="fake", block_size=16, total_blocks=64)


async def _ids(address: str) -> set[str]:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await pb_grpc.MetaStoreStub(ch).List(pb.ListRequest())
    return {r.info.instance_id for r in reply.instances}


async def test_a_watcher_of_one_replica_sees_instances_of_the_other(replicas):
    a, b = replicas
    async with grpc.aio.insecure_channel(a.address) as cha, grpc.aio.insecure_channel(b.address) as chb:
        sa, sb = pb_grpc.MetaStoreStub(cha), pb_grpc.MetaStoreStub(chb)
        watch = sb.Watch(pb.WatchRequest())
        it = watch.__aiter__()
        assert (await it.__anext__()).type == pb.WatchEvent.SYNCED
        await sa.Register(pb.RegisterRequest(info=_info("x")))
        ev = await asyncio.wait_for(it.__anext__(), 5)
        assert ev.type == pb.WatchEvent.ADDED and ev.record.info.instance_id == "x"
        assert (await sa.ReportStatus(cpb.InstanceStatus(instance_id="x", seq=1, freeness=4.5))).known
        ev = await asyncio.wait_for(it.__anext__(), 5)
        assert ev.type == pb.WatchEvent.UPDATED and ev.record.status.freeness == 4.5
        # Silent: its lease runs out in etcd, and both replicas drop it.
        ev = await asyncio.wait_for(it.__anext__(), 5)
        assert ev.type == pb.WatchEvent.REMOVED and ev.record.info.instance_id == "x"
        await until(lambda: "x" not in a.registry._records)
        assert not (await sa.ReportStatus(cpb.InstanceStatus(instance_id="x", seq=2))).known
        watch.cancel()


async def test_an_instance_that_keeps_reporting_stays_and_deregisters_everywhere(replicas):
    a, b = replicas
    async with grpc.aio.insecure_channel(a.address) as cha, grpc.aio.insecure_channel(b.address) as chb:
        sa, sb = pb_grpc.MetaStoreStub(cha), pb_grpc.MetaStoreStub(chb)
        await sa.Register(pb.RegisterRequest(info=_info("y")))
        for seq in range(1, 16):  # 3 TTLs
            assert (await sa.ReportStatus(cpb.InstanceStatus(instance_id="y", seq=seq))).known
            await asyncio.sleep(TTL / 5)
        assert "y" in await _ids(b.address)
        # Deregistered through the other replica: gone from both.
        assert (await sb.Deregister(pb.DeregisterRequest(instance_id="y"))).existed
        await until(lambda: "y" not in a.registry._records)


async def test_an_instance_moves_to_the_other_replica_when_its_own_dies(replicas):
    a, b = replicas
    async with grpc.aio.insecure_channel(a.address) as cha, grpc.aio.insecure_channel(b.address) as chb:
        sa, sb = pb_grpc.MetaStoreStub(cha), pb_grpc.MetaStoreStub(chb)
        await sa.Register(pb.RegisterRequest(info=_info("z")))
        await sa.ReportStatus(cpb.InstanceStatus(instance_id="z", seq=1))
        await until(lambda: "z" in b.registry._records)
        await a.stop()
        # The instance goes on with b (as its reporter does: register, report).
        await sb.Register(pb.RegisterRequest(info=_info("z")))
        for seq in range(2, 16):
            assert (await sb.ReportStatus(cpb.InstanceStatus(instance_id="z", seq=seq))).known
            await asyncio.sleep(TTL / 5)
        assert "z" in await _ids(b.address)
        # A replica started afterwards learns it from etcd.
        c = await Replica(a.svc.config.etcd).start()
        try:
            assert "z" in await _ids(c.address)
        finally:
            await c.stop()


async def test_while_etcd_is_down_the_local_ttl_decides_and_etcd_gets_it_back(replicas, etcd_server):  # noqa: F811
    a, b = replicas
    async with grpc.aio.insecure_channel(a.address) as cha:
        sa = pb_grpc.MetaStoreStub(cha)
        await sa.Register(pb.RegisterRequest(info=_info("live")))
        await sa.Register(pb.RegisterRequest(info=_info("dead")))
        await until(lambda: {"live", "dead"} <= set(b.registry._records))
        etcd_server.stop()
        await until(lambda: not a.registry.connected and not b.registry.connected)
        # Replica a goes on: "live" keeps reporting to it, "dead" does not.
        for seq in range(1, 11):
            assert (await sa.ReportStatus(cpb.InstanceStatus(instance_id="live", seq=seq))).known
            await asyncio.sleep(TTL / 5)
        assert await _ids(a.address) == {"live"}
        # Replica b hears from neither: both expired there (no dead dispatch target).
        assert await _ids(b.address) == set()
        etcd_server.start()
        await until(lambda: a.registry.connected and b.registry.connected)
        # etcd renews every lease when it restarts: "dead" comes back from it
        # for one TTL, then expires; "live" stays (a renews it).
        seq, ids = 11, None
        for seq in range(11, 61):
            await sa.ReportStatus(cpb.InstanceStatus(instance_id="live", seq=seq))
            await asyncio.sleep(TTL / 10)
            ids = await _ids(b.address)
            if ids == {"live"} and seq > 20:
                break
        assert ids == {"live"}, f"after {seq - 10} reports: {ids}"
