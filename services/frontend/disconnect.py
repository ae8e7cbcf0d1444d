"""Work nobody waits for stops: a request's work raced against its client's
disconnect. Starlette tells a handler nothing when the client goes away
before the response starts (a non-streaming request, or a stream before its
first token), so the request went on computing to the end for nobody."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, TypeVar

from services.frontend import metrics

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected; its request's work was cancelled."""


async def _disconnected(receive) -> None:
    # NOTE: after the body was read, receive() returns only when the client
    # disconnects (uvicorn); every call after that returns at once.
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive, work: Awaitable[T], when: str) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is
    cancelled (its cleanup runs: the instance call is cancelled, which
    aborts the request there and frees its blocks) and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await gone
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    metrics.DISCONNECTS.labels(when).inc()
    raise ClientGone(when)
