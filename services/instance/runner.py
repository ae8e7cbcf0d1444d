"""Runs an engine in its own thread and bridges it to the agent's asyncio
loop without blocking either: commands go in through a thread-safe queue and
run between steps; outputs come back once per step via call_soon_threadsafe.

Pipeline peers' steps (KunServe, services/instance/kunserve.py) come in on a
second queue, ``guest_call``: they run between steps like commands, and also
*inside* a step while that step waits for a peer (``wait_serving_guests``).
Two instances that are each other's peers would otherwise deadlock, each
engine thread waiting on the other. Remote attention (the live KV exchange)
adds a third queue, ``attend_call``: a peer running this instance's layers
asks this engine for attention over its own cache, from inside a peer's step
that runs here or there; a wait inside a peer's step serves only those
(``wait_serving_guests(..., attends_only=True)``), so that no peer's step
ever runs inside another one.

If the thread dies (the engine raised out of a step), the step callback gets
``load=None`` once, and every command queued or sent afterwards fails at
once with EngineBroken: nobody awaits a dead engine forever."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import queue
import threading
import time
import traceback
from typing import Any, Callable

from libs.common import failpoints
from libs.common.logging import get_logger
from libs.common.types import TokenOutput
from services.instance.engine.base import Engine, EngineBroken, EngineLoad

log = get_logger(__name__)

StepCallback = Callable[[list[TokenOutput], EngineLoad], None]


class EngineRunner:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, on_step: StepCallback,
                 idle_wait_s: float = 0.05, on_kv_events: Callable[[list], None] | None = None):
        """``on_kv_events``: called on the loop with the prefix cache's events
        (Engine.take_kv_events) after each step or command that made any,
        in order, before that step's ``on_step``."""
        self.engine = engine
        self.loop = loop
        self.on_step = on_step
        self.on_kv_events = on_kv_events
        # Called on the engine thread with each step's outputs, right after the step and before they
        # reach the loop (Handoffs.at_boundary: export what the step held); its errors are logged.
        self.at_boundary: Callable[[list[TokenOutput]], None] | None = None
        self.idle_wait_s = idle_wait_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._guests: queue.SimpleQueue = queue.SimpleQueue()
        self._attends: queue.SimpleQueue = queue.SimpleQueue()
        self._guest_wake = threading.Event()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # key -> (monotonic time the hold is for, time it ends): no step starts (hold, expect)
        self._holds: dict[str, tuple[float, float]] = {}
        self._holds_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        self.last_step_s = 0.0  # wall time of the latest step
        self._recent_steps: collections.deque[float] = collections.deque(maxlen=64)  # their wall times
        self._step_t0: float | None = None  # perf_counter at the start of the step under way
        self.error: BaseException | None = None
        self.dead = False

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the engine thread between steps; await its result.
        Raises EngineBroken if the engine thread is dead."""
        fut = self.loop.create_future()
        self._cmds.put((fn, args, fut))
        self._wake.set()
        if self.dead:  # NOTE: after the put: the thread may have died between a check and the put
            self._fail_pending()
        return await fut

    async def guest_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a pipeline peer's work on the engine thread: between steps, or
        inside a step that waits for a peer (module doc); await its result."""
        return await self._queued(self._guests, fn, args)

    async def attend_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run remote attention for a peer on the engine thread, wherever it
        waits on a peer (module doc); await its result."""
        return await self._queued(self._attends, fn, args)

    async def _queued(self, q: queue.SimpleQueue, fn: Callable[..., Any], args: tuple) -> Any:
        fut = self.loop.create_future()
        q.put((fn, args, fut))
        self._guest_wake.set()
        self._wake.set()
        if self.dead:
            self._fail_pending()
        return await fut

    def wait_serving_guests(self, fut: concurrent.futures.Future, timeout_s: float,
                            attends_only: bool = False) -> Any:
        """On the engine thread, inside a step: wait for ``fut`` (a call to a
        pipeline peer) while running the peers' work queued here (only their
        attention: ``attends_only``, inside a peer's step). Raises
        TimeoutError after ``timeout_s``."""
        fut.add_done_callback(lambda _: self._guest_wake.set())
        deadline = time.monotonic() + timeout_s
        while True:
            self._guest_wake.clear()  # NOTE: before draining, so that no wake is lost
            self._drain(self._attends)
            if not attends_only:
                self._drain(self._guests)
            if fut.done():
                return fut.result()
            left = deadline - time.monotonic()
            if left <= 0:
                fut.cancel()
                raise TimeoutError(f"no reply from a pipeline peer in {timeout_s:g} s")
            self._guest_wake.wait(min(left, 0.05))

    def hold(self, key: str, seconds: float) -> None:
        """Any thread: start no step for up to ``seconds`` unless ``release(key)``
        comes first; commands still run meanwhile. For a request about to join
        (a migration's commit): it joins the next step instead of waiting for
        the end of one that began meanwhile."""
        now = time.monotonic()
        with self._holds_lock:
            self._holds[key] = (now, now + seconds)

    def expect(self, key: str, at: float, seconds: float) -> None:
        """Any thread: a request is expected to join at monotonic time ``at``
        (a migration's commit, announced before the source suspends it). At
        a step boundary less than half a step before ``at``, no step starts
        (until ``release(key)``, or ``seconds`` after ``at``): a step begun
        there would keep the request waiting longer than holding keeps the
        others. Earlier boundaries step as usual. So neither waits more
        than about half a step. A later ``hold(key, ...)`` replaces it."""
        with self._holds_lock:
            self._holds[key] = (at, at + seconds)

    def to_boundary_s(self) -> float:
        """Any thread: about how long until the step under way ends (the
        latest step's duration since it began; 0 between steps)."""
        t0 = self._step_t0
        if t0 is None:
            return 0.0
        return max(0.0, t0 + self.last_step_s - time.perf_counter())

    def step_running_s(self) -> float:
        """Any thread: how long the step under way has run (0 between steps)."""
        t0 = self._step_t0
        return 0.0 if t0 is None else max(0.0, time.perf_counter() - t0)

    def expected_step_s(self) -> float | None:
        """The longest of the recent steps (a long prompt's chunk included);
        None before the first step."""
        return max(self._recent_steps, default=None)

    def release(self, key: str) -> None:
        """Any thread: end the hold ``key`` (none: nothing happens)."""
        with self._holds_lock:
            held = self._holds.pop(key, None)
        if held is not None:
            self._wake.set()

    def _held_for(self) -> float:
        """Seconds left of the longest hold in force (0: none); drops the
        expired ones. An expected join is in force from half a step before
        it. Called before every step: no lock while there is none (the
        common case)."""
        if not self._holds:
            return 0.0
        now = time.monotonic()
        half = self.last_step_s / 2
        with self._holds_lock:
            for k in [k for k, (_, end) in self._holds.items() if end <= now]:
                del self._holds[k]
            return max((end - now for at, end in self._holds.values() if now >= at - half), default=0.0)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget (errors are logged)."""
        self._cmds.put((fn, args, None))
        self._wake.set()

    def _fail_pending(self) -> None:
        err = EngineBroken(f"the engine thread died: {self.error!r}")
        for q in (self._cmds, self._guests, self._attends):
            while True:
                try:
                    _, _, fut = q.get_nowait()
                except queue.Empty:
                    break
                self._resolve(fut, exc=err)

    def _resolve(self, fut: asyncio.Future | None, result: Any = None, exc: BaseException | None = None):
        if fut is None:
            if exc is not None:
                log.error("engine command failed", error=repr(exc))
            return

        def settle():
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self.loop.call_soon_threadsafe(settle)

    def _drain(self, q: queue.SimpleQueue | None = None) -> bool:
        """Run what is queued: pipeline peers' work first, then commands (or only ``q``)."""
        if q is None:
            ran = self._drain(self._attends)
            ran = self._drain(self._guests) or ran
            return self._drain(self._cmds) or ran
        ran = False
        while True:
            try:
                fn, args, fut = q.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            try:
                self._resolve(fut, fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._resolve(fut, exc=e)

    def _run(self) -> None:
        die_after = failpoints.value("engine.die_after_steps")
        hang_after = failpoints.value("engine.hang_after_steps")  # tests: a step that never returns
        try:
            if self.on_kv_events is not None:
                self.engine.take_kv_events()  # recording starts (the cache is empty)
            while not self._stop.is_set():
                changed = self._drain()
                held = self._held_for()
                if held > 0:
                    if changed:
                        self._publish([])
                    self._wake.wait(held)
                    self._wake.clear()
                    continue
                if self.engine.has_work():
                    if die_after is not None and self.steps >= int(die_after):
                        raise EngineBroken(f"failpoint: engine.die_after_steps={die_after}")
                    t = self._step_t0 = time.perf_counter()
                    if hang_after is not None and self.steps >= int(hang_after):
                        self._stop.wait()
                        return
                    outputs = self.engine.step()
                    self._step_t0 = None
                    self.last_step_s = time.perf_counter() - t
                    self._recent_steps.append(self.last_step_s)
                    self.steps += 1
                    if self.at_boundary is not None and outputs:
                        self._at_boundary(outputs)
                    self._publish(outputs)
                    continue
                if changed:
                    self._publish([])
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
        except BaseException as e:  # noqa: BLE001
            self.error = e
            self.dead = True
            log.error("engine thread died", error=repr(e), traceback=traceback.format_exc())
            self._fail_pending()
            try:
                self.loop.call_soon_threadsafe(self.on_step, [], None)
            except RuntimeError:  # loop closed during shutdown
                pass

    def _at_boundary(self, outputs: list[TokenOutput]) -> None:
        try:
            self.at_boundary(outputs)
        except Exception as e:  # noqa: BLE001 - an optimization: what it skipped is done at the next boundary
            log.warning("step boundary hook failed", error=repr(e))

    def _publish(self, outputs: list[TokenOutput]) -> None:
        load = self.engine.load()
        try:
            if self.on_kv_events is not None:
                events = self.engine.take_kv_events()
                if events:
                    self.loop.call_soon_threadsafe(self.on_kv_events, events)
            self.loop.call_soon_threadsafe(self.on_step, outputs, load)
        except RuntimeError:  # loop closed during shutdown
            self._stop.set()
