"""The frontend's side of ``Scheduler.DispatchStream``: one long-lived
bidirectional stream that every request's dispatch shares. A unary
``Dispatch`` costs about twice the round trip of a message on an open stream
(grpc.aio, loopback: 0.8 vs 0.4 ms), and it is on every request's path to
its first token.

Replies carry their request_id, so a reply that comes after its caller gave
up is dropped, never handed to another request. When the stream breaks
(the scheduler restarts, or it stops answering), every caller waiting on it
gets the error and the next dispatch opens a new stream. A scheduler
without the method (UNIMPLEMENTED) leaves the caller on unary calls."""

from __future__ import annotations

import asyncio

import grpc

from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from libs.common.errors import Code, FerryError, is_unavailable
from libs.common.logging import get_logger

log = get_logger(__name__)


class StreamBroken(Exception):
    """The dispatch stream ended or was given up; ``unavailable``: as a
    scheduler that does not answer (the caller's bypass rule applies)."""

    def __init__(self, error: BaseException | None, unavailable: bool = True):
        super().__init__(str(error) if error is not None else "dispatch stream ended")
        self.error = error
        self.unavailable = unavailable


class _Stream:
    """One open DispatchStream call, its queue of requests to send and the
    callers waiting for a reply."""

    def __init__(self, stub: spb_grpc.SchedulerStub):
        self.queue: asyncio.Queue[spb.DispatchRequest | None] = asyncio.Queue()
        self.waiting: dict[str, asyncio.Future] = {}
        self.broken: StreamBroken | None = None
        self.call = stub.DispatchStream(self._requests())
        self.reader = asyncio.create_task(self._read())

    async def _requests(self):
        while (req := await self.queue.get()) is not None:
            yield req

    async def _read(self) -> None:
        broken = StreamBroken(None)
        try:
            async for reply in self.call:
                fut = self.waiting.get(reply.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except grpc.RpcError as e:
            broken = StreamBroken(e, unavailable=is_unavailable(e) or e.code() == grpc.StatusCode.CANCELLED)
        finally:
            self.break_(broken)

    def break_(self, why: StreamBroken) -> None:
        if self.broken is None:
            self.broken = why
            self.queue.put_nowait(None)
            self.call.cancel()
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(why)
        self.waiting.clear()

    async def ask(self, req: spb.DispatchRequest, timeout_s: float) -> spb.DispatchReply:
        if self.broken is not None:
            raise self.broken
        fut = asyncio.get_running_loop().create_future()
        self.waiting[req.request_id] = fut
        self.queue.put_nowait(req)
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            # No answer in time: the stream may be stuck behind a scheduler
            # that stopped reading. Give it up (the others waiting on it get
            # the same error); the next dispatch opens a new one.
            why = StreamBroken(FerryError("dispatch timed out", code=Code.DEADLINE_EXCEEDED))
            self.break_(why)
            raise why from None
        finally:
            self.waiting.pop(req.request_id, None)


class DispatchStream:
    """``ask(request)`` -> the scheduler's DispatchReply over the shared
    stream (opened on first use, reopened after a break). Raises
    StreamBroken; ``supported`` turns False for a scheduler without the
    method."""

    def __init__(self, stub: spb_grpc.SchedulerStub, enabled: bool = True):
        self._stub = stub
        self._stream: _Stream | None = None
        self.supported = enabled

    async def ask(self, req: spb.DispatchRequest, timeout_s: float) -> spb.DispatchReply:
        if self._stream is None or self._stream.broken is not None:
            self._stream = _Stream(self._stub)
        if self.busy(req.request_id):
            raise ValueError(f"request {req.request_id!r} is already being dispatched on the stream")
        try:
            return await self._stream.ask(req, timeout_s)
        except StreamBroken as e:
            if isinstance(e.error, grpc.RpcError) and e.error.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("the scheduler has no DispatchStream; dispatching with unary calls")
                self.supported = False
            raise

    def busy(self, request_id: str) -> bool:
        """A dispatch of this request id waits on the stream (its replies
        could not be told apart: ask the second one with a unary call)."""
        return self._stream is not None and request_id in self._stream.waiting

    async def close(self) -> None:
        s, self._stream = self._stream, None
        if s is not None:
            s.break_(StreamBroken(None))
            s.reader.cancel()
            await asyncio.gather(s.reader, return_exceptions=True)
