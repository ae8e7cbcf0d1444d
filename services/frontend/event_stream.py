"""The streaming responses' SSE: the headers and the first event leave
together, before any task is made for the rest.

sse-starlette's EventSourceResponse (kept for its event encoding) starts a
stream by making an anyio task group and four tasks (the stream, pings, a
shutdown watcher, a disconnect listener) and sends the headers from the first
of them: on this machine 0.3-0.4 ms between the handler's return and the first
byte, on every request's time to first token. Here the first event is written
at once (the handler computed it: it waited for the first token before
answering); the tasks for the rest (the stream, keep-alive pings, the
disconnect listener) start after it is out.

A client that goes away cancels the stream's task: the events' generator
gets the cancellation at its await (the request's instance call is cancelled
there, which aborts the request and frees its KV). So does a client that
stays but stops reading: an event it does not take within
``write_timeout_s`` (the socket's buffers full) ends the stream the same way;
the connection is closed."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from sse_starlette import ServerSentEvent  # (the package exports it in 2.x and 3.x)
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from libs.common.logging import get_logger
from services.frontend import metrics

log = get_logger(__name__)

HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def encode(data: str) -> bytes:
    return ServerSentEvent(data=data).encode()


class EventStream(StreamingResponse):
    """``first``: the first event's data; ``rest``: the data of the events
    after it. A comment is sent every ``ping_s`` seconds while the stream is
    open (proxies and clients that time out idle connections). Starlette's
    streaming response gives the headers (no content-length); its sending
    is replaced."""

    media_type = "text/event-stream"

    def __init__(self, first: str, rest: AsyncIterator[str], ping_s: float = 15.0, write_timeout_s: float = 30.0):
        super().__init__(rest, headers=HEADERS)
        self.first = first
        self.ping_s = ping_s
        self.write_timeout_s = write_timeout_s
        self._lock = asyncio.Lock()

    async def _send(self, send: Send, body: bytes, more: bool = True) -> None:
        """One write, within the write timeout (TimeoutError: the client does not read).
        NOTE: asyncio.timeout, not wait_for: Python 3.11's wait_for returns the
        write's result when a cancel (the client went away) comes as the write
        completes, and the stream went on to its request's end."""
        async with self._lock, asyncio.timeout(self.write_timeout_s):
            await send({"type": "http.response.body", "body": body, "more_body": more})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": encode(self.first), "more_body": True})
        # The stream's task first: it starts the events' generator before the
        # disconnect listener can end anything, so a cancel always lands inside
        # the generator and its cleanup runs.
        stream = asyncio.ensure_future(self._stream(send))
        others = [asyncio.ensure_future(self._disconnected(receive))]
        if self.ping_s > 0:
            others.append(asyncio.ensure_future(self._ping(send)))
        waits = [stream, others[0]] + others[1:]  # a ping that cannot be written ends it too
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if stream not in done:  # cut by the client: gone, or not reading
                why = "disconnected" if others[0] in done else "not reading (ping)"
                log.info("stream ended by its client", why=why)
        finally:
            for t in (stream, *others):
                t.cancel()
            for t in others:
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await t
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await stream  # its error, if it failed, is the response's (not a slow reader's)

    async def _stream(self, send: Send) -> None:
        try:
            async for data in self.body_iterator:
                await self._send(send, encode(data))
        except TimeoutError:
            metrics.DISCONNECTS.labels("slow_reader").inc()
            log.info("stream ended by its client", why=f"not reading ({self.write_timeout_s:g}s)")
            raise
        finally:
            await self.body_iterator.aclose()  # cancels the request's instance call if it did not end
        await self._send(send, b"", more=False)

    async def _ping(self, send: Send) -> None:
        while True:
            await asyncio.sleep(self.ping_s)
            await self._send(send, ServerSentEvent(comment="ping").encode())

    @staticmethod
    async def _disconnected(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
