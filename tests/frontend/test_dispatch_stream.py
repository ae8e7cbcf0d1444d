"""The frontend's dispatch over one long-lived stream to the scheduler
(services/frontend/dispatch_stream.py), against a scheduler servicer on
loopback gRPC whose answers the tests script: replies out of order reach
their own callers, an error reply fails one request and keeps the stream, a
reply that never comes gives the caller the bypass rule and a fresh stream
to the next, and a scheduler without the method is asked with unary calls."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from libs.common.errors import Code, FerryError, Unavailable
from libs.common.types import Priority
from services.frontend.dispatch_stream import DispatchStream, StreamBroken
from services.frontend.router import Router


def placed(request_id: str) -> spb.DispatchReply:
    return spb.DispatchReply(request_id=request_id, instance_id=f"at-{request_id}", address="127.0.0.1:1")


class ScriptedScheduler(spb_grpc.SchedulerServicer):
    """DispatchStream answers by request id: "err-*" with an invalid-argument
    error, "down-*" with unavailable, "mute-*" never; a batch of ``hold``
    requests is answered in reverse order. Dispatch (unary) answers all."""

    def __init__(self, hold: int = 1):
        self.hold = hold
        self.streams = 0
        self.unary = 0

    async def Dispatch(self, request, context):
        self.unary += 1
        return placed(request.request_id)

    async def DispatchStream(self, request_iterator, context):
        self.streams += 1
        batch = []
        async for r in request_iterator:
            rid = r.request_id
            if rid.startswith("mute-"):
                continue
            if rid.startswith("err-"):
                yield spb.DispatchReply(request_id=rid, error_code=Code.INVALID_ARGUMENT.value, error_message="bad")
                continue
            if rid.startswith("down-"):
                yield spb.DispatchReply(request_id=rid, error_code=Code.UNAVAILABLE.value, error_message="no view")
                continue
            batch.append(rid)
            if len(batch) == self.hold:
                for b in reversed(batch):
                    yield placed(b)
                batch = []


class UnaryOnly(spb_grpc.SchedulerServicer):
    def __init__(self):
        self.unary = 0

    async def Dispatch(self, request, context):
        self.unary += 1
        return placed(request.request_id)


@pytest.fixture
async def serve():
    servers = []

    async def start(servicer) -> str:
        server = grpc.aio.server()
        spb_grpc.add_SchedulerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        await s.stop(None)


async def test_replies_out_of_order_reach_their_own_callers(serve):
    sched = ScriptedScheduler(hold=4)
    async with grpc.aio.insecure_channel(await serve(sched)) as ch:
        ds = DispatchStream(spb_grpc.SchedulerStub(ch))
        ids = [f"r{i}" for i in range(8)]
        replies = await asyncio.gather(*(ds.ask(spb.DispatchRequest(request_id=i), 5.0) for i in ids))
        assert [r.instance_id for r in replies] == [f"at-{i}" for i in ids]
        assert sched.streams == 1 and sched.unary == 0
        await ds.close()


async def test_an_error_fails_its_request_only_and_the_stream_stays(serve):
    sched = ScriptedScheduler()
    router = Router(await serve(sched), "127.0.0.1:1")
    try:
        with pytest.raises(FerryError) as e:
            await router.dispatch("err-1", 8, Priority.NORMAL)
        assert e.value.code is Code.INVALID_ARGUMENT
        assert not router.bypass
        got = await router.dispatch("ok-1", 8, Priority.NORMAL)
        assert got.instance_id == "at-ok-1"
        assert sched.streams == 1 and sched.unary == 0
        # unavailable: the bypass rule (no instance known here, so the local dispatch refuses)
        with pytest.raises(Unavailable):
            await router.dispatch("down-1", 8, Priority.NORMAL)
        assert router.bypass
    finally:
        await router.close()


async def test_a_reply_that_never_comes_breaks_the_stream_and_the_next_opens_another(serve):
    sched = ScriptedScheduler()
    async with grpc.aio.insecure_channel(await serve(sched)) as ch:
        ds = DispatchStream(spb_grpc.SchedulerStub(ch))
        # one caller waits on the mute request, another on one answered after it on the same stream
        with pytest.raises(StreamBroken) as e:
            await ds.ask(spb.DispatchRequest(request_id="mute-1"), 0.3)
        assert e.value.unavailable
        r = await ds.ask(spb.DispatchRequest(request_id="r1"), 5.0)
        assert r.instance_id == "at-r1"
        assert sched.streams == 2
        await ds.close()


async def test_the_same_request_id_twice_at_once_goes_unary_the_second_time(serve):
    sched = ScriptedScheduler()
    router = Router(await serve(sched), "127.0.0.1:1", dispatch_timeout_s=5.0)
    try:
        first = asyncio.create_task(router.dispatch("mute-x", 8, Priority.NORMAL))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError):  # the stream itself refuses to match two
            await router._stream.ask(spb.DispatchRequest(request_id="mute-x"), 5.0)
        got = await router.dispatch("mute-x", 8, Priority.NORMAL)
        assert got.instance_id == "at-mute-x" and sched.unary == 1
        first.cancel()
    finally:
        await router.close()


async def test_an_unknown_error_code_is_an_internal_error(serve):
    class NewCodes(ScriptedScheduler):
        async def DispatchStream(self, request_iterator, context):
            async for r in request_iterator:
                yield spb.DispatchReply(request_id=r.request_id, error_code="from_the_future", error_message="?")
    router = Router(await serve(NewCodes()), "127.0.0.1:1")
    try:
        with pytest.raises(FerryError) as e:
            await router.dispatch("r", 8, Priority.NORMAL)
        assert e.value.code is Code.INTERNAL
    finally:
        await router.close()


async def test_a_scheduler_without_the_stream_is_asked_with_unary_calls(serve):
    sched = UnaryOnly()
    # a generous timeout: the UNIMPLEMENTED answer, not a slow machine's deadline, is what moves it to unary
    router = Router(await serve(sched), "127.0.0.1:1", dispatch_timeout_s=10.0)
    try:
        for i in range(3):
            got = await router.dispatch(f"r{i}", 8, Priority.NORMAL)
            assert got.instance_id == f"at-r{i}"
        assert sched.unary == 3 and not router.bypass
    finally:
        await router.close()


async def test_a_scheduler_that_goes_away_gives_waiting_callers_the_bypass_rule(serve):
    sched = ScriptedScheduler()
    server = grpc.aio.server()
    spb_grpc.add_SchedulerServicer_to_server(sched, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        ds = DispatchStream(spb_grpc.SchedulerStub(ch))
        waiting = asyncio.create_task(ds.ask(spb.DispatchRequest(request_id="mute-2"), 10.0))
        await asyncio.sleep(0.1)
        await server.stop(None)
        with pytest.raises(StreamBroken) as e:
            await asyncio.wait_for(waiting, 5.0)
        assert e.value.unavailable
        await ds.close()


async def test_a_stream_broken_with_another_status_is_asked_again_with_a_unary_call(serve):
    """A scheduler killed mid-stream may end it with INTERNAL ("Internal
    error from Core"), not UNAVAILABLE: the requests waiting on it are no
    worse for it (they were 500s); the unary call's own answer decides."""
    class Crashing(ScriptedScheduler):
        async def DispatchStream(self, request_iterator, context):
            self.streams += 1
            async for _ in request_iterator:
                await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
    sched = Crashing()
    router = Router(await serve(sched), "127.0.0.1:1", dispatch_timeout_s=5.0)
    try:
        got = await asyncio.gather(*(router.dispatch(f"r{i}", 8, Priority.NORMAL) for i in range(3)))
        assert [g.instance_id for g in got] == ["at-r0", "at-r1", "at-r2"]
        assert sched.unary == 3 and not router.bypass
    finally:
        await router.close()
