"""The live orchestration's asyncio code on the simulator's virtual clock.

``SimLoop`` is an asyncio event loop whose time is the Kernel's and whose
callbacks are Kernel events: ``call_soon`` and ``call_at`` push onto the
Kernel's queue (same time: in the order scheduled), so asyncio tasks,
futures, ``asyncio.sleep`` and ``wait_for`` of the live services interleave
deterministically with the simulator's own processes. Nothing runs in a
thread: an engine call waits for the simulated instance's next step boundary
(``SimRunner``), a copy off the loop runs inline (``MigrationHost.offload``),
and a peer's round trips and KV transfers are charged as delays
(``DelayedPeer``).

Each simulated instance's live MigrationManager runs on it (ferry/sim/run.py):
the scheduler's migrate-out orders are the manager's (scheduler.py), and a
Splitwise handoff is the manager's Handoffs, planned when the request enters
the prefill instance, as the live agent does (run.py ``_generate``).
KunServe's groups are formed and restored by the scheduler's live
KunServeLoop on this loop; its instance clients are simulated members
(kunserve.py ``SimPipeline``) whose engine calls go through a SimRunner.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from ferry.sim.kernel import Kernel, Wait
from services.instance.streams import RequestStream, StreamTable


class SimLoop(asyncio.BaseEventLoop):
    def __init__(self, kernel: Kernel):
        super().__init__()
        self.kernel = kernel

    def time(self) -> float:
        return self.kernel.now

    def call_soon(self, callback: Callable, *args: Any, context=None) -> asyncio.Handle:
        h = asyncio.Handle(callback, args, self, context)
        self.kernel.at(self.kernel.now, _run, h)
        return h

    def call_soon_threadsafe(self, callback: Callable, *args: Any, context=None) -> asyncio.Handle:
        return self.call_soon(callback, *args, context=context)

    def call_at(self, when: float, callback: Callable, *args: Any, context=None) -> asyncio.TimerHandle:
        h = asyncio.TimerHandle(when, callback, args, self, context)
        self.kernel.at(when, _run, h)
        return h

    def _timer_handle_cancelled(self, handle) -> None:
        pass  # a cancelled handle stays on the Kernel's queue and does nothing when its time comes

    def run_in_executor(self, executor, func, *args):
        raise RuntimeError("no threads on the simulated clock: run it inline (MigrationHost.offload)")

    def run(self, until: float) -> None:
        """Run the Kernel (and so this loop's callbacks) until ``until``,
        with this loop as the running loop."""
        self.kernel.loop = self
        self.kernel.run(until)

    @contextlib.contextmanager
    def running(self):
        """This loop as the running one outside ``run`` (to create tasks)."""
        before = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(self)
        try:
            yield self
        finally:
            asyncio.events._set_running_loop(before)


class TaskDone(Wait):
    """What a Kernel process yields to wait for an asyncio task on the
    loop: it resumes with the task's result (or its exception thrown in)."""

    def __init__(self, task: asyncio.Task):
        self.task = task

    def arm(self, kernel, resume, fail) -> None:
        def done(t: asyncio.Task) -> None:
            if t.cancelled():
                kernel.after(0.0, fail, asyncio.CancelledError())
            elif t.exception() is not None:
                kernel.after(0.0, fail, t.exception())
            else:
                kernel.after(0.0, resume, t.result())

        self.task.add_done_callback(done)


def _run(h: asyncio.Handle) -> None:
    if not h._cancelled:
        h._run()


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class SimRunner:
    """services/instance/runner.EngineRunner for a simulated instance: a call
    runs at the instance's next step boundary (at once when idle) and its
    result reaches the loop ``hop_s`` later, as the live engine thread's
    hand-off to the event loop; holding a boundary for an incoming commit is
    not modelled."""

    def __init__(self, inst, loop: SimLoop):
        self.inst, self.loop = inst, loop
        self.engine = inst.engine
        self.dead = False
        self.error = None

    async def call(self, fn: Callable, *args: Any) -> Any:
        fut = self.loop.create_future()
        k, hop = self.inst.k, self.inst.hop_s

        def done(result: Any, exc: BaseException | None) -> None:
            k.after(hop, _settle, fut, result, exc)

        self.inst.submit(fn, *args, done=done)
        return await fut

    def submit(self, fn: Callable, *args: Any) -> None:
        self.inst.submit(fn, *args)

    def hold(self, key: str, seconds: float) -> None:
        pass

    def release(self, key: str) -> None:
        pass

    def expect(self, key: str, at: float, seconds: float) -> None:
        pass

    @property
    def at_boundary(self) -> Callable | None:
        return self.inst.at_boundary

    @at_boundary.setter
    def at_boundary(self, fn: Callable | None) -> None:
        self.inst.at_boundary = fn  # called at each step's end, before the outputs are recorded

    def to_boundary_s(self) -> float:
        inst = self.inst
        return max(0.0, inst.clock.t - inst.k.now) if inst._stepping else 0.0

    @property
    def last_step_s(self) -> float:
        return self.inst._last_step_s

    @property
    def steps(self) -> int:
        return self.inst.steps


async def inline(fn: Callable, *args: Any) -> Any:
    """MigrationHost.offload on the simulated clock: the copy runs at once."""
    return fn(*args)


class _Unread:
    """The queue of a stream nobody reads (``_FollowedStream``)."""

    @staticmethod
    def put_nowait(ev) -> None:
        pass


class _FollowedStream(RequestStream):
    """A stream nobody reads: its indexes and its end as the live one keeps
    them, its events dropped (the recorder reads the engines' outputs as
    the agent's observer)."""

    def __init__(self, request_id: str, next_index: int = 0):
        self.request_id, self.next_index = request_id, next_index
        self.queue = _Unread()
        self.closed = False
        self.attached = True


class FollowedStreams(StreamTable):
    """A simulated client follows every request (the recorder reads the
    engines' outputs): a stream is attached as it opens."""

    def open(self, request_id: str, next_index: int = 0):
        s = _FollowedStream(request_id, next_index)
        self._streams[request_id] = s
        return s


class DelayedPeer:
    """An in-process destination peer that charges the simulator's costs:
    half a round trip each way of every call, and a stage's blocks over the
    link (``transfer_s(blocks)``) after a round trip. A per-layer stage
    (Splitwise, layerwise.py) streams while the prompt computes: each layer
    chunk takes ``layer_s(its bytes)`` on the link, in order, from when the
    source hands it over, and the round trip comes once at the end."""

    def __init__(self, inner, rpc_s: float, transfer_s: Callable[[int], float],
                 layer_s: Callable[[int], float] | None = None):
        self.inner, self.rpc_s, self.transfer_s, self.layer_s = inner, rpc_s, transfer_s, layer_s

    async def _call(self, name: str, *args: Any) -> Any:
        await asyncio.sleep(self.rpc_s / 2)
        result = await getattr(self.inner, name)(*args)
        await asyncio.sleep(self.rpc_s / 2)
        return result

    async def pre_allocate(self, p):
        return await self._call("pre_allocate", p)

    async def transfer(self, chunks):
        layered = False

        async def paced():
            nonlocal layered
            loop = asyncio.get_running_loop()
            link_free = 0.0  # when the link has sent what went before
            async for c in chunks:
                if c.layer is not None and len(c.data) and self.layer_s is not None:
                    layered = True
                    link_free = max(link_free, loop.time()) + self.layer_s(len(c.data))
                    await asyncio.sleep(link_free - loop.time())
                yield c

        written = await self.inner.transfer(paced())
        blocks = written[0] if isinstance(written, tuple) else written
        await asyncio.sleep(self.rpc_s + (0.0 if layered else self.transfer_s(blocks)))
        return written

    async def commit(self, migration_id, state, last=None):
        return await self._call("commit", migration_id, state, last)

    async def commit_cache(self, migration_id, kv):
        return await self._call("commit_cache", migration_id, kv)

    async def expect_commit(self, migration_id, in_ms):
        return await self._call("expect_commit", migration_id, in_ms)

    async def abort(self, migration_id, reason):
        return await self._call("abort", migration_id, reason)

    async def settled(self, migration_id, wait_ms):
        return await self._call("settled", migration_id, wait_ms)
