"""One simulated instance: the live agent (services/instance/agent.py
``Agent``: its streams, step delivery, migration manager, Splitwise
handoffs, role, terminating mark and status) on the simulator's ports. The
engine core (CoreEngine: block pool, scheduler, preemption, migration hooks)
is stepped on the virtual clock; the engine-thread contract of
services/instance/runner.py (calls run between steps) is ``submit`` and
ferry/sim/aio.py's SimRunner; its reports go when the live reporter's
``ReportTimer`` (services/instance/reporter.py: after a step that changes
blocks, queue or states, at most every report_interval_s, and a heartbeat)
says, on the virtual clock, each report the agent's own ``status``.

A step's duration is SimProfile.step_ms over the step's chunks (chunk_cost),
as the live sim engine sleeps; the executor emits a non-EOS token per
sampling chunk and stores no KV. With ``fake_tokens`` it is the live sim
engine's executor instead (the fake model over a token-id KV, tokens read
back from the KV), so KV handed between instances is checked by the tokens.

An instance has a role (Splitwise: mixed, prefill or decode), reported in
its status, and its own profile (a heterogeneous cluster).

Published load: the live agent reports the load the engine thread published
after its last step (or after calls, when idle). ``engine.step()`` changes
the engine at the step's start in virtual time, so the simulator keeps the
published load by computing ``engine.load()`` before a change whenever a
report or a migrate-out order may read it before the next publish.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ferry.sim.kernel import Kernel, Wait
from libs.common.types import InstanceStatus, Priority, Role, TokenOutput
from services.instance.agent import Agent
from services.instance.config import InstanceConfig
from services.instance.engine.base import EngineConfig, EngineLoad, KvLayout
from services.instance.engine.core.engine import CoreEngine
from services.instance.engine.core.executor import Executor, tapped_chunks
from services.instance.engine.core.scheduler import ScheduledChunk
from services.instance.engine.fake import TokenKvExecutor
from services.instance.engine.sim import SimProfile, chunk_cost
from services.instance.registered import Everyone
from services.instance.reporter import ReportTimer

SAMPLED_TOKEN = 97  # any id that is not EOS (the executor has no EOS)
TAP_LAYERS = 16  # a per-layer handoff's taps per step, at most (StepTimeExecutor)


class EngineClock:
    """The engine core's clock: the kernel's time at a step's start, moved
    to the step's end by the executor (the core stamps tokens after
    executing)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# What the executor tells the instance of every step: (chunks, start, end).
StepObserver = Callable[[list[ScheduledChunk], float, float], None]


class _Timed:
    """The virtual step time and the per-instance counters, shared by both executors."""

    def _init_timing(self, profile: SimProfile, clock: EngineClock) -> None:
        self.profile = profile
        self.clock = clock
        self.observer: StepObserver | None = None
        # KunServe's pipelined groups (ferry/sim/kunserve.py): the profile's
        # step time in ms -> the step time this instance takes.
        self.stretch: Callable[[float], float] | None = None
        # Runs fn(*args) at a virtual time (the kernel's ``at``): a layer's tap
        # when the layer is computed. None: taps run as the step starts.
        self.defer: Callable[..., None] | None = None
        self.prefill_tokens = 0  # tokens of chunks that start inside the prompt (recomputes included)
        self.decode_tokens = 0  # chunks that start past the prompt (one token each)
        self.busy_s = 0.0

    def _advance(self, chunks: list[ScheduledChunk]) -> None:
        start = self.clock.t
        ms = self.profile.step_ms(*chunk_cost(chunks))
        self.clock.t += (ms if self.stretch is None else self.stretch(ms)) / 1000.0
        self.busy_s += self.clock.t - start
        for c in chunks:
            if c.start < len(c.request.prompt_token_ids):
                self.prefill_tokens += c.num_new
            else:
                self.decode_tokens += c.num_new
        if self.observer is not None:
            self.observer(chunks, start, self.clock.t)


class StepTimeExecutor(_Timed, Executor):
    """Step times from the profile, no KV stored. Layer taps (a per-layer
    Splitwise handoff, services/instance/migration/layerwise.py): the KV
    layout's layers are the profile's, in at most TAP_LAYERS groups of
    consecutive layers (one K and V value per token and group), and group g
    of L of a step of D seconds is handed to its tap at start + (g+1) D / L,
    as layers finish in turn; the last one at the step's end, before the
    step boundary (the tap queues the request's suspend there). The groups
    keep the simulator fast (each tap is a few events of the live handoff
    code); what they cost in accuracy is the last group's share of the
    transfer, exposed after the prompt where one layer's would be."""

    eos_token_ids: frozenset[int] = frozenset()
    vocab_size = TokenKvExecutor.vocab_size  # the live sim engine's
    layer_taps = True

    def __init__(self, profile: SimProfile, clock: EngineClock):
        self._init_timing(profile, clock)
        self._layout = KvLayout("float32", profile.block_size, min(TAP_LAYERS, max(1, profile.num_layers)), 1, 1)

    @property
    def kv_layout(self) -> KvLayout:
        return self._layout

    def execute(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        start = self.clock.t
        self._advance(chunks)
        taps = tapped_chunks(chunks, self._layout)
        if taps:
            self._tap(taps, start, self.clock.t)
        return [SAMPLED_TOKEN if c.samples else None for c in chunks]

    def _tap(self, taps, start: float, end: float) -> None:
        layers = self._layout.num_layers
        per_layer = self._layout.bytes_per_block // layers
        for t in taps:
            data = memoryview(bytes(len(t.block_ids) * per_layer)) if t.copy else None
            for layer in range(layers):
                kv = t.layer_kv(layer, data)  # now: the step's outputs change the request
                if self.defer is None:
                    t.tap(kv)
                else:  # the last layer exactly at the end: before the step boundary's event
                    at = end if layer == layers - 1 else start + (end - start) * (layer + 1) / layers
                    self.defer(at, t.tap, kv)

    def gather_kv(self, block_ids: list[int]) -> memoryview:
        # No KV is stored: zeros of the (token-sized) layout, so that a migration's stages carry
        # their blocks' count; what they cost is the transfer model's (ferry/sim/aio.py DelayedPeer).
        return memoryview(bytes(len(block_ids) * self._layout.bytes_per_block))

    def grow_kv(self, num_blocks: int, fresh=None, holding=None) -> None:
        pass  # stores no KV

    def scatter_kv(self, block_ids: list[int], data: bytes | memoryview) -> None:
        pass

    def scatter_kv_layer(self, block_ids: list[int], layer: int, data: bytes | memoryview) -> None:
        pass


class FakeTokenExecutor(_Timed, TokenKvExecutor):
    """The live sim engine's executor (fake model over a token-id KV) on the
    virtual clock: slower, for checks of exact tokens across handoffs. Its
    KV has one layer, handed to a tap as the step starts (no overlap to
    model: timing checks of per-layer handoffs use StepTimeExecutor)."""

    def __init__(self, profile: SimProfile, clock: EngineClock, num_blocks: int):
        TokenKvExecutor.__init__(self, num_blocks, profile.block_size)
        self._init_timing(profile, clock)

    def execute(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        out = self.compute(chunks)
        self._advance(chunks)
        return out


class EngineCall(Wait):
    """Wait for fn(*args) to run on the instance's engine at its next step
    boundary (at once when idle); resume with its result."""

    def __init__(self, inst: SimInstance, fn: Callable, args: tuple):
        self.inst, self.fn, self.args = inst, fn, args

    def arm(self, kernel, resume, fail) -> None:
        hop = self.inst.hop_s

        def done(result: Any, exc: BaseException | None) -> None:
            if exc is not None:
                kernel.after(hop, fail, exc)
            else:
                kernel.after(hop, resume, result)

        self.inst.submit(self.fn, *self.args, done=done)


class SimInstance:
    def __init__(self, kernel: Kernel, instance_id: str, profile: SimProfile, engine_config: EngineConfig,
                 headroom: dict[Priority, int], report_interval_s: float, heartbeat_s: float, hop_s: float,
                 on_step: Callable[[SimInstance, list[TokenOutput]], None] | None,
                 on_report: Callable[[SimInstance, InstanceStatus], None], role: Role = Role.MIXED,
                 fake_tokens: bool = False, config: InstanceConfig | None = None):
        """``config``: the agent's (a live instance's flags; default: the
        defaults with no queue bound); ``on_step(inst, outputs)``: follows the
        agent's step delivery (one of its observers)."""
        self.k = kernel
        self.instance_id = instance_id
        self.profile = profile
        self.clock = EngineClock()
        num_blocks = engine_config.num_blocks or profile.num_blocks
        self.executor = (FakeTokenExecutor(profile, self.clock, num_blocks) if fake_tokens
                         else StepTimeExecutor(profile, self.clock))
        self.executor.defer = kernel.at
        self.engine = CoreEngine(engine_config, self.executor, num_blocks,
                                 engine_config.max_model_len or profile.max_model_len, model_name=profile.name,
                                 clock=self.clock)
        self.headroom = headroom
        self.hop_s = hop_s
        self.at_boundary: Callable | None = None
        self.orders = 0  # migrate-out orders running here (they read the status)
        self.stopped = False
        # Engine thread.
        self._cmds: list[tuple[Callable, tuple, Callable | None]] = []
        self._stepping = False
        self._wake_armed = False
        self._last_step_s = 0.05
        self.steps = 0
        # Published load and the reporter.
        self._pub_load: EngineLoad | None = None
        self._mutated = False  # the engine changed since the last publish
        self._key: tuple = ()
        self.timer = ReportTimer(self.status, lambda status: on_report(self, status), report_interval_s,
                                 heartbeat_s, lambda: kernel.now, kernel.at)
        from ferry.sim.aio import FollowedStreams

        config = config or InstanceConfig(max_queued_tokens=0)
        config = replace(config, instance_id=instance_id, role=role.value)
        self.agent = Agent(config, registered=Everyone(), engine=self.engine, streams=FollowedStreams(),
                           headroom=headroom, published_load=self.published_load, clock=lambda: kernel.now)
        self.agent.reporter = self
        if on_step is not None:
            self.agent.observers.append(_StepFollower(self, on_step))
        self.runner = None  # serve(): ferry/sim/aio.py's SimRunner
        self._publish()

    def serve(self, loop, migration_config, peers, fault, expire_interval_s: float) -> None:
        """The agent's migration manager, handoffs and pipeline host on the
        cluster's SimLoop (``Agent.attach_ports``): the engine through a
        SimRunner, the virtual clock, copies inline; ``peers(address)``: a
        destination's migration peer."""
        from ferry.sim.aio import SimRunner, inline

        self.runner = SimRunner(self, loop)
        with loop.running():
            self.agent.attach_ports(self.runner, migration_config=migration_config, load=self.engine.load,
                                    clock=lambda: self.k.now, offload=inline, fault=fault,
                                    expire_interval_s=expire_interval_s, peers=peers)

    # --- the agent's state ----------------------------------------------------------------
    @property
    def role(self) -> Role:
        return self.agent.role

    @property
    def terminating(self) -> bool:
        return self.agent.terminating

    @property
    def manager(self):
        """The agent's live MigrationManager (None before ``serve``)."""
        return self.agent.migration

    # --- the engine thread (runner.py) --------------------------------------------------
    def call(self, fn: Callable, *args: Any) -> EngineCall:
        return EngineCall(self, fn, args)

    def submit(self, fn: Callable, *args: Any, done: Callable[[Any, BaseException | None], None] | None = None):
        """Run fn(*args) between two steps (runner.submit / runner.call)."""
        self._cmds.append((fn, args, done))
        if not self._stepping and not self._wake_armed:
            self._wake_armed = True
            self.k.at(self.k.now, self._wake)

    def _wake(self) -> None:
        self._wake_armed = False
        if not self._stepping:
            self._boundary()

    def _boundary(self) -> None:
        """Between steps: run the queued calls, then step or go idle."""
        cmds, self._cmds = self._cmds, []
        if cmds:
            self._before_change()
        for fn, args, done in cmds:
            try:
                result, exc = fn(*args), None
            except Exception as e:  # noqa: BLE001 - handed to the caller, as runner.call does
                result, exc = None, e
            if done is not None:
                done(result, exc)
        if self.engine.has_work():
            self._start_step()
        else:
            if cmds:
                self._publish()
            self._wake_at_pin_expiry()

    def _wake_at_pin_expiry(self) -> None:
        """Idle or blocked with programs pinned (core/pins.py): wake when the
        first pin's TTL passes, which frees its blocks (the live engine thread
        expires them at its next step or published load)."""
        t = self.engine.pins.next_expiry()
        if t is not None and t != getattr(self, "_pin_wake", None):
            self._pin_wake = t
            self.k.at(max(self.k.now, t), self._pin_expired)

    def _pin_expired(self) -> None:
        self._pin_wake = None
        if self._stepping:
            return  # the step's end looks again
        self._before_change()
        self.clock.t = self.k.now
        self.engine.load()  # expires what is due
        self._publish()
        self._boundary()

    def _start_step(self) -> None:
        self._before_change()
        now = self.k.now
        self.clock.t = now
        outputs = self.engine.step()
        if self.clock.t == now:
            # Nothing could be scheduled (the head of the queue does not fit
            # and nothing runs): the live engine thread spins publishing the
            # same load; here it waits for the next call, or for a pinned
            # program's TTL to pass (core/pins.py), which frees its blocks.
            self._publish()
            self._wake_at_pin_expiry()
            return
        self._stepping = True
        self._last_step_s = self.clock.t - now
        self.k.at(self.clock.t, self._step_end, outputs)

    def _step_end(self, outputs: list[TokenOutput]) -> None:
        self._stepping = False
        self.steps += 1
        if outputs:
            if self.at_boundary is not None:  # runner.EngineRunner.at_boundary
                self.at_boundary(outputs)
            self.agent.deliver(outputs)  # the load is published lazily (below)
        self._publish()
        self._boundary()

    # --- published load and status reports (service.py, reporter.py) -------------------
    def _cheap_key(self) -> tuple:
        """Changes whenever ``material(engine.load())`` does (blocks, queue,
        states; tests/sim check it over random runs), at O(1) per step."""
        s = self.engine.scheduler
        pool = self.engine.pool
        # NOTE: with prefix caching a request may finish and another join with
        # the same free count (it hit blocks in use), and blocks named in a
        # step change a waiting request's demand: admissions and cached blocks.
        return (pool.num_free, pool.num_reserved, len(s.waiting), len(s.running), s.num_preemptions,
                s.num_admitted, pool.num_cached)

    def _publish(self) -> None:
        self._pub_load = None
        self._mutated = False
        key = self._cheap_key()
        if key != self._key:
            self._key = key
            self.poke()
        self.timer.readable()  # a report that could not read the load it was due goes now

    def _before_change(self) -> None:
        """The engine is about to change: keep the published load if a report
        or an order may read it before the next publish."""
        if self._pub_load is None and not self._mutated:
            horizon = self.k.now + 1.5 * self._last_step_s + self.hop_s
            due = self.timer.due
            if self.orders or (due is not None and due <= horizon):
                self._pub_load = self.engine.load()
        self._mutated = True

    def published_load(self) -> EngineLoad | None:
        if self._pub_load is None and not self._mutated:
            self._pub_load = self.engine.load()
        return self._pub_load

    def status(self) -> InstanceStatus | None:
        """The agent's status: its published load (None while it cannot be read) and marks."""
        return self.agent.status()

    def migrations_under_way(self) -> int:
        """Migrations and handoffs in and out now (the live manager's)."""
        m = self.manager
        return m.migrating_in + m.migrating_out if m is not None else 0

    def poke(self) -> None:
        """The load changed: report soon (the agent's reporter port)."""
        self.timer.poke()

    @property
    def reports(self) -> int:
        return self.timer.reports

    @property
    def late_reports(self) -> int:
        return self.timer.late_reports

    def set_terminating(self, value: bool) -> None:
        self.agent.set_terminating(value)

    def stop(self) -> None:
        self.stopped = True
        self.timer.stop()


class _StepFollower:
    """An agent observer that hands each step's outputs to ``on_step(inst, outputs)``."""

    def __init__(self, inst: SimInstance, on_step: Callable[[SimInstance, list[TokenOutput]], None]):
        self.inst, self.on_step_fn = inst, on_step

    def arrived(self, request_id: str, num_prompt_tokens: int, num_resumed: int) -> None:
        pass

    def on_step(self, outputs: list[TokenOutput], load) -> None:
        self.on_step_fn(self.inst, outputs)

    def committed_in(self, state) -> None:
        pass

    def left(self, request_id: str) -> None:
        pass
