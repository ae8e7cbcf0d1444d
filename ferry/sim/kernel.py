"""The discrete-event kernel: a virtual clock, a queue of timed callbacks, and
processes written as generators that yield what they wait for.

Events at the same time run in the order they were scheduled (a sequence
number breaks ties), so a run is a deterministic function of its inputs.

NOTE: virtual time starts at ``START`` (1 s), not 0: the engine core uses 0.0
as "not yet" for its timestamps (first token, preemption start), and an
arrival at time 0 would read as "no arrival time".
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Generator
from typing import Any

START = 1.0


class Kernel:
    def __init__(self, start: float = START):
        self.start = start
        self.now = start
        self._queue: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()
        self.events = 0
        # An asyncio loop on this clock (ferry/sim/aio.py SimLoop): the running loop while run() runs.
        self.loop: asyncio.AbstractEventLoop | None = None

    def at(self, t: float, fn: Callable, *args: Any) -> None:
        """Run fn(*args) at time t (not before now)."""
        heapq.heappush(self._queue, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = float("inf")) -> None:
        """Run events in time order until the queue is empty or the next
        event is after ``until``."""
        q = self._queue
        pop = heapq.heappop
        before = asyncio.events._get_running_loop()
        if self.loop is not None:
            asyncio.events._set_running_loop(self.loop)
        try:
            while q and q[0][0] <= until:
                t, _, fn, args = pop(q)
                self.now = t
                self.events += 1
                fn(*args)
        finally:
            asyncio.events._set_running_loop(before)

    def idle(self) -> bool:
        return not self._queue

    def spawn(self, gen: Generator, on_done: Callable[[Any], None] | None = None) -> Process:
        p = Process(self, gen, on_done)
        self.at(self.now, p.resume, None)
        return p


class Wait:
    """What a process yields. ``arm`` arranges for ``resume(value)`` (or
    ``fail(exc)``) to be called once the wait is over."""

    def arm(self, kernel: Kernel, resume: Callable[[Any], None], fail: Callable[[BaseException], None]) -> None:
        raise NotImplementedError


class Delay(Wait):
    def __init__(self, seconds: float):
        self.seconds = max(0.0, seconds)

    def arm(self, kernel, resume, fail) -> None:
        kernel.after(self.seconds, resume, None)


class Process:
    """A generator driven by the kernel. It yields Waits; the value a wait
    ends with is sent back in (an exception is thrown in). Its return value
    goes to ``on_done``."""

    def __init__(self, kernel: Kernel, gen: Generator, on_done: Callable[[Any], None] | None = None):
        self.kernel = kernel
        self.gen = gen
        self.on_done = on_done
        self.done = False
        self.result: Any = None

    def resume(self, value: Any) -> None:
        self._advance(lambda: self.gen.send(value))

    def fail(self, exc: BaseException) -> None:
        self._advance(lambda: self.gen.throw(exc))

    def _advance(self, step: Callable[[], Any]) -> None:
        try:
            wait = step()
        except StopIteration as stop:
            self.done = True
            self.result = stop.value
            if self.on_done:
                self.on_done(stop.value)
            return
        wait.arm(self.kernel, self.resume, self.fail)
