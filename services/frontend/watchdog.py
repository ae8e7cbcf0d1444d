"""No request waits forever: the frontend watches every instance stream it
reads, and one that brings no event for ``stall_s`` is checked with the
instance. It is stalled when the instance does not hold the request, cannot
be reached, or holds it while its engine makes no step; then the stream's
call is cancelled (which aborts the request there) and the request resumes
elsewhere like after an instance crash. A request that waits in a queue
while its engine steps is not stalled: that is load, not a fault."""

from __future__ import annotations

import asyncio
import time

import grpc

from libs.pb import instance_pb2 as ipb
from libs.common.logging import get_logger
from services.frontend import metrics

log = get_logger(__name__)


class Watched:
    """One instance stream of one request."""

    __slots__ = (
        "address",
        "call",
        "checking",
        "instance_id",
        "last_event",
        "request_id",
        "stalled",
        "steps_seen",
    )

    def __init__(self, request_id: str, instance_id: str, address: str, call):
        self.request_id = request_id
        self.instance_id = instance_id
        self.address = address
        self.call = call
        self.last_event = time.monotonic()
        self.steps_seen: int | None = None  # the instance's engine steps at the last check
        self.checking = False
        self.stalled: str | None = None  # why, once the call was cancelled for a stall

    def touch(self) -> None:
        self.last_event = time.monotonic()
        self.steps_seen = None


class StallWatchdog:
    def __init__(self, instance_stub, stall_s: float, interval_s: float | None = None):
        """``instance_stub(address)`` gives an Instance stub; ``stall_s`` <= 0
        turns the watchdog off."""
        self.instance_stub = instance_stub
        self.stall_s = stall_s
        self.interval_s = interval_s or max(0.05, min(5.0, stall_s / 4))
        self._watched: set[Watched] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.stall_s > 0:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def watch(self, request_id: str, instance_id: str, address: str, call) -> Watched:
        w = Watched(request_id, instance_id, address, call)
        self._watched.add(w)
        return w

    def unwatch(self, w: Watched) -> None:
        self._watched.discard(w)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            for w in list(self._watched):
                if not w.checking and now - w.last_event > self.stall_s:
                    w.checking = True
                    asyncio.create_task(self._check(w))

    async def _check(self, w: Watched) -> None:
        silent_since = w.last_event
        try:
            why = await self._verdict(w)
        finally:
            w.checking = False
        if why is None or w not in self._watched or w.last_event != silent_since:  # an event came meanwhile
            return
        w.stalled = why
        metrics.STALLED.inc()
        log.warning("request stalled; resuming it elsewhere", request_id=w.request_id, instance_id=w.instance_id,
                    reason=why, silent_s=round(time.monotonic() - w.last_event, 1))
        w.call.cancel()

    async def _verdict(self, w: Watched) -> str | None:
        """Why the request is stalled, or None if it is only waiting."""
        try:
            st = await self.instance_stub(w.address).GetStatus(ipb.GetStatusRequest(), timeout=5.0)
        except grpc.RpcError as e:
            return f"instance {w.instance_id} does not answer ({e.code().name})"
        if not any(r.request_id == w.request_id for r in st.requests):
            return f"instance {w.instance_id} does not hold the request"
        if w.steps_seen is not None and st.engine_steps == w.steps_seen:
            return f"instance {w.instance_id}'s engine made no step for {self.stall_s:g}s"
        w.steps_seen = st.engine_steps
        # Look again a whole period on: one step may be long (a long prompt's
        # chunk on a loaded CPU), and a step in progress does not count yet.
        # NOTE: checking again one interval on declared engines dead in the
        # middle of a 5-second step (an 8,000-token prompt, `ferry bench
        # migration`); a dead engine is now found after two periods.
        w.last_event = time.monotonic()
        return None
