"""The scheduler's DispatchStream on loopback gRPC: every request gets its
own reply, in order, with Dispatch's decision; a request that cannot be
placed, or whose placement fails, gets an error reply and the stream goes
on for the next one."""

from __future__ import annotations

import grpc

from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from libs.common.errors import Code, Unavailable
from services.scheduler.service import SchedulerServicer


class Servicer(SchedulerServicer):
    """The real DispatchStream over a scripted placement."""

    def __init__(self):
        super().__init__(svc=None)

    def _dispatch(self, request):
        if request.request_id.startswith("none-"):
            raise Unavailable("no live instance to dispatch to")
        if request.request_id.startswith("bug-"):
            raise KeyError("a bug")
        return spb.DispatchReply(instance_id=f"at-{request.request_id}", address="127.0.0.1:1")


async def test_each_request_gets_its_reply_and_failures_do_not_end_the_stream():
    server = grpc.aio.server()
    spb_grpc.add_SchedulerServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            ids = ["a", "none-1", "b", "bug-1", "c"]
            call = spb_grpc.SchedulerStub(ch).DispatchStream(
                iter([spb.DispatchRequest(request_id=i, num_prompt_tokens=8) for i in ids]))
            replies = [r async for r in call]
        assert [r.request_id for r in replies] == ids
        by = {r.request_id: r for r in replies}
        assert [by[i].instance_id for i in ("a", "b", "c")] == ["at-a", "at-b", "at-c"]
        assert by["none-1"].error_code == Code.UNAVAILABLE.value and not by["none-1"].instance_id
        assert by["bug-1"].error_code == Code.INTERNAL.value and "a bug" in by["bug-1"].error_message
        assert all(not by[i].error_code for i in ("a", "b", "c"))
    finally:
        await server.stop(None)
