"""The cluster view keeps its last view across a meta store restart."""

import asyncio

from libs.pb import common_pb2 as cpb
from libs.pb import meta_store_pb2 as pb
from libs.pb import meta_store_pb2_grpc as pb_grpc
from libs.common.cluster_view import ClusterView
from libs.common.server import serve
from services.meta_store.service import MetaStoreConfig, MetaStoreService


async def start_store(port=0):
    stop = asyncio.Event()
    ready = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(MetaStoreService(MetaStoreConfig(port=port, ttl_s=5)), "127.0.0.1", port,
                                     stop_event=stop, ready=ready.set_result, grace_s=0))
    return await asyncio.wait_for(ready, 10), stop, task


async def test_instances_survive_a_meta_store_restart_until_they_reregister():
    import grpc

    address, stop, task = await start_store()
    port = int(address.rsplit(":", 1)[1])
    info = cpb.InstanceInfo(instance_id="i0", address="127.0.0.1:1", block_size=16, total_blocks=64)
    async with grpc.aio.insecure_channel(address) as ch:
        await pb_grpc.MetaStoreStub(ch).Register(pb.RegisterRequest(info=info))
    view = ClusterView(address, carry_over_s=0.5)
    view.start()
    await asyncio.wait_for(view.synced.wait(), 5)
    assert list(view.records) == ["i0"]
    stop.set()
    await task
    for _ in range(100):  # the watch notices the loss
        if not view.connected:
            break
        await asyncio.sleep(0.01)
    assert not view.connected
    _, stop2, task2 = await start_store(port)  # restarted: empty
    for _ in range(200):  # the watch re-syncs with the empty store
        if view.connected:
            break
        await asyncio.sleep(0.01)
    assert view.connected
    assert list(view.records) == ["i0"]  # carried over while it re-registers
    await asyncio.sleep(0.6)
    view.views()
    assert list(view.records) == []  # never came back: dropped after the grace period
    await view.stop()
    stop2.set()
    await task2


async def test_a_store_that_has_not_heard_a_status_yet_does_not_blank_it():
    """A re-watch to a store (a replica just started) that knows the instance
    but not yet its status: the view keeps the status it had, so the instance
    stays a dispatch target (and counts for the autoscaler)."""
    import grpc

    address, stop, task = await start_store()
    port = int(address.rsplit(":", 1)[1])
    info = cpb.InstanceInfo(instance_id="i0", address="127.0.0.1:1", block_size=16, total_blocks=64)
    async with grpc.aio.insecure_channel(address) as ch:
        await pb_grpc.MetaStoreStub(ch).Register(pb.RegisterRequest(info=info))
        await pb_grpc.MetaStoreStub(ch).ReportStatus(cpb.InstanceStatus(instance_id="i0", seq=1, freeness=3.0))
    view = ClusterView(address)
    view.start()
    for _ in range(200):
        if view.views():
            break
        await asyncio.sleep(0.01)
    assert [v.status.freeness for v in view.views()] == [3.0]
    stop.set()
    await task
    address2, stop2, task2 = await start_store(port)
    async with grpc.aio.insecure_channel(address2) as ch:  # registered, no report yet
        await pb_grpc.MetaStoreStub(ch).Register(pb.RegisterRequest(info=info))
    for _ in range(200):
        if view.connected:
            break
        await asyncio.sleep(0.01)
    assert view.connected
    assert [v.status.freeness for v in view.views()] == [3.0]
    await view.stop()
    stop2.set()
    await task2
async def test_the_view_survives_an_exception_that_is_not_an_rpc_error(monkeypatch):
    """A record that fails to convert (any exception, not only a failed
    call) must not end the watch for good: the view watches again."""
    import grpc

    from libs.common import cluster_view

    address, stop, task = await start_store()
    info = cpb.InstanceInfo(instance_id="i0", address="127.0.0.1:1", block_size=16, total_blocks=64)
    async with grpc.aio.insecure_channel(address) as ch:
        await pb_grpc.MetaStoreStub(ch).Register(pb.RegisterRequest(info=info))
    real = cluster_view.convert.info_from_pb
    calls = {"n": 0}

    def flaky(m):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("a record this version cannot read")
        return real(m)
    monkeypatch.setattr(cluster_view.convert, "info_from_pb", flaky)
    view = ClusterView(address)
    view.start()
    await asyncio.wait_for(view.synced.wait(), 5)
    assert list(view.records) == ["i0"] and calls["n"] >= 2
    await view.stop()
    stop.set()
    await task
