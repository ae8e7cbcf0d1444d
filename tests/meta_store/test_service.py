"""The meta store over real gRPC on loopback."""

import asyncio

import grpc
import pytest

from libs.pb import common_pb2 as cpb
from libs.pb import meta_store_pb2 as pb
from libs.pb import meta_store_pb2_grpc as pb_grpc
from libs.common.server import serve
from libs.common.types import InstanceInfo, InstanceStatus
from services.instance.reporter import StatusReporter
from services.meta_store.service import MetaStoreConfig, MetaStoreService


@pytest.fixture
async def store_address(request):
    """A meta store on loopback; its TTL 0.4 s unless a test parametrizes it (indirect)."""
    stop = asyncio.Event()
    ready = asyncio.get_running_loop().create_future()
    svc = MetaStoreService(MetaStoreConfig(port=0, ttl_s=getattr(request, "param", 0.4)))
    task = asyncio.create_task(serve(svc, "127.0.0.1", 0, stop_event=stop, ready=ready.set_result))
    yield await asyncio.wait_for(ready, 10)
    stop.set()
    await task


@pytest.fixture
async def store(store_address):
    async with grpc.aio.insecure_channel(store_address) as ch:
        yield pb_grpc.MetaStoreStub(ch)


def _info(i):
    return cpb.InstanceInfo(instance_id=i, address="127.0.0.1:1", engine="fake", block_size=16, total_blocks=64)


async def test_watch_sees_register_report_and_ttl_expiry(store):
    await store.Register(pb.RegisterRequest(info=_info("a")))
    call = store.Watch(pb.WatchRequest())
    it = call.__aiter__()
    ev = await it.__anext__()
    assert ev.type == pb.WatchEvent.ADDED and ev.record.info.instance_id == "a"
    assert (await it.__anext__()).type == pb.WatchEvent.SYNCED
    reply = await store.ReportStatus(cpb.InstanceStatus(instance_id="a", seq=1, freeness=7.5))
    assert reply.known
    ev = await it.__anext__()
    assert ev.type == pb.WatchEvent.UPDATED and ev.record.status.freeness == 7.5
    # Stop reporting: the TTL (0.4 s) removes it.
    ev = await asyncio.wait_for(it.__anext__(), 3)
    assert ev.type == pb.WatchEvent.REMOVED and ev.record.info.instance_id == "a"
    assert len((await store.List(pb.ListRequest())).instances) == 0
    reply = await store.ReportStatus(cpb.InstanceStatus(instance_id="a", seq=2))
    assert not reply.known  # must register again
    call.cancel()


async def test_reporting_instance_stays_alive(store):
    await store.Register(pb.RegisterRequest(info=_info("b")))
    for seq in range(1, 8):
        await store.ReportStatus(cpb.InstanceStatus(instance_id="b", seq=seq))
        await asyncio.sleep(0.15)
    ids = [r.info.instance_id for r in (await store.List(pb.ListRequest())).instances]
    assert ids == ["b"]


async def test_thinned_watch_sends_latest_status_per_interval(store):
    """With min_update_interval_s, a burst of reports reaches the watcher as
    the first one and then the latest one when the interval is up; a full-rate
    watcher beside it still sees every report; a removal is not held back."""
    await store.Register(pb.RegisterRequest(info=_info("c")))
    thin = store.Watch(pb.WatchRequest(min_update_interval_s=0.3)).__aiter__()
    full = store.Watch(pb.WatchRequest()).__aiter__()
    for it in (thin, full):
        assert (await it.__anext__()).type == pb.WatchEvent.ADDED
        assert (await it.__anext__()).type == pb.WatchEvent.SYNCED
    for seq in range(1, 11):
        await store.ReportStatus(cpb.InstanceStatus(instance_id="c", seq=seq, freeness=float(seq)))
    got_full = [(await full.__anext__()).record.status.seq for _ in range(10)]
    assert got_full == list(range(1, 11))
    first = await thin.__anext__()
    assert first.type == pb.WatchEvent.UPDATED and first.record.status.seq == 1
    t0 = asyncio.get_running_loop().time()
    latest = await asyncio.wait_for(thin.__anext__(), 2)
    waited = asyncio.get_running_loop().time() - t0
    assert latest.type == pb.WatchEvent.UPDATED and latest.record.status.seq == 10
    assert waited > 0.15  # held until the interval was up, not sent at once
    # A report then a removal inside one interval: the removal goes at once,
    # and the held report is dropped, not sent after it.
    await store.ReportStatus(cpb.InstanceStatus(instance_id="c", seq=11))
    await store.Deregister(pb.DeregisterRequest(instance_id="c"))
    ev = await asyncio.wait_for(thin.__anext__(), 1)
    assert ev.type == pb.WatchEvent.REMOVED
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(thin.__anext__(), 0.5)


async def test_status_stream_reports_and_ends_when_the_instance_is_unknown(store):
    await store.Register(pb.RegisterRequest(info=_info("s")))
    watch = store.Watch(pb.WatchRequest())
    it = watch.__aiter__()
    assert (await it.__anext__()).type == pb.WatchEvent.ADDED
    assert (await it.__anext__()).type == pb.WatchEvent.SYNCED
    call = store.StreamStatus()
    for seq in (1, 2, 3):
        await call.write(cpb.InstanceStatus(instance_id="s", seq=seq, freeness=float(seq)))
    seen = [(await it.__anext__()).record.status.freeness for _ in range(3)]
    assert seen == [1.0, 2.0, 3.0]
    await store.Deregister(pb.DeregisterRequest(instance_id="s"))
    assert (await it.__anext__()).type == pb.WatchEvent.REMOVED
    await call.write(cpb.InstanceStatus(instance_id="s", seq=4))
    reply = await asyncio.wait_for(call.read(), 3)
    assert reply != grpc.aio.EOF and not reply.known  # register again
    assert await asyncio.wait_for(call.read(), 3) == grpc.aio.EOF  # and the call is over
    assert len((await store.List(pb.ListRequest())).instances) == 0
    watch.cancel()


async def test_reporter_registers_again_after_the_store_forgets_it(store_address, store):
    seq = 0

    def snapshot():
        nonlocal seq
        seq += 1
        return InstanceStatus(instance_id="r", seq=seq, free_blocks=seq)

    info = InstanceInfo("r", "127.0.0.1:1", "fake", "m", 16, 64, 128)
    reporter = StatusReporter(store_address, info, snapshot, min_interval_s=0.01, heartbeat_s=0.05)
    reporter.start()

    async def listed_after(n_reports):
        for _ in range(200):
            recs = (await store.List(pb.ListRequest())).instances
            if recs and recs[0].status.seq > n_reports:
                return recs[0]
            await asyncio.sleep(0.02)
        raise AssertionError("the reporter's status never arrived")

    try:
        rec = await listed_after(2)  # heartbeats flow over the stream
        assert rec.info.instance_id == "r" and rec.status.free_blocks == rec.status.seq
        await store.Deregister(pb.DeregisterRequest(instance_id="r"))
        before = reporter.reports
        rec = await listed_after(before + 2)  # it registered again and kept reporting
        assert rec.info.instance_id == "r" and reporter.registered
    finally:
        await reporter.stop(deregister=True)
    assert len((await store.List(pb.ListRequest())).instances) == 0
