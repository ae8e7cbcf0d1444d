"""The instance agent ("llumlet") without its transport: engine runner,
token streams, migration manager, role, status report and the step
callback, with plain methods (generate, attach, abort, set_role,
check_integrity, ...). services/instance/service.py serves it over gRPC.

What it runs on are its ports. ``start`` makes a process's: the engine
from the config, the engine thread (runner.py), the meta store's status
reporter and registry, metrics and the hang monitor. The simulator gives
its own (ferry/sim/instance.py): the engine core on the virtual clock, a
runner that calls between simulated steps, the reporter's timing on that
clock; then ``attach`` wires the rest as it does for a process (streams,
migration manager, KunServe's pipeline host, the step callback)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from libs.common import failpoints, tracing
from libs.common.errors import (
    Code,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from libs.common.kv_events import KvEventBatch, KvSnapshot
from libs.common.logging import get_logger
from libs.common.server import Service
from libs.common.types import GenerateOrder, InstanceInfo, InstanceStatus, Role, StreamEvent, TokenOutput
from libs.common.validation import request_id_problem, sampling_problem
from services.instance.admission import QueueBound
from services.instance.config import InstanceConfig
from services.instance.engine import create_engine
from services.instance.engine.base import EngineBroken, EngineError, EngineLoad, EngineRequest
from services.instance.hang import HangLimits, HangMonitor, Health
from services.instance.kv_events import KvEventPublisher
from services.instance.registered import Registered
from services.instance.reporter import StatusReporter
from services.instance.runner import EngineRunner
from services.instance.status import high_priority_headroom, instance_status, material
from services.instance.streams import Event, StreamTable, serve_attached, serve_stream

log = get_logger(__name__)

# Exit status of an instance whose engine died (the launcher, ferry up and
# compose see a crash; its requests resume elsewhere by recompute).
EXIT_ENGINE_DIED = 3
EXIT_ENGINE_HUNG = 4  # a step ran past --hang-stop-s (services/instance/hang.py)


@dataclass(frozen=True)
class Integrity:
    error: str  # "" when the engine's bookkeeping is consistent
    free_blocks: int
    total_blocks: int
    num_requests: int
    num_reservations: int
    cached_block_hashes: list[int] = field(default_factory=list)


class Agent(Service):
    """The llumlet, with no transport: its engine runner, token streams,
    migration manager, role, status and one step callback; plain methods for
    what a client or a peer asks of it. ``services/instance/service.py``
    serves it over gRPC (translation only)."""

    name = "instance"
    service_names = ("ferry.v1.Instance",)

    def __init__(self, config: InstanceConfig, migration_peers=None, registered=None, *, engine=None,
                 streams: StreamTable | None = None, headroom: dict | None = None,
                 published_load: Callable[[], EngineLoad | None] | None = None,
                 clock: Callable[[], float] = time.time):
        """``migration_peers``: address -> migration peer (default: gRPC;
        agents in one process: services.instance.migration.peer.InProcessPeer);
        ``registered``: who says which instances the meta store knows, and at
        which address (default: the meta store). The simulator's ports
        (module doc): ``engine`` (default: the config's), ``streams``,
        ``headroom`` (default: from the engine's profile), the load a status
        reads (``published_load``, None while it cannot be read; default:
        the engine thread's latest) and the ``clock`` of statuses and
        arrivals."""
        self.config = config
        self._migration_peers = migration_peers
        if config.failpoints:  # first: the engine and its thread read theirs when they start
            failpoints.configure(config.failpoints)
        self.instance_id = config.instance_id or f"inst-{uuid.uuid4().hex[:8]}"
        self.engine = engine if engine is not None else create_engine(config.engine_config())
        if Role.parse(config.role) is Role.PREFILL and self.engine.no_migration:
            raise ValueError(f"--role prefill needs live migration to hand requests over, and this "
                             f"{self.engine.name} engine cannot migrate: {self.engine.no_migration}")
        self.streams = streams if streams is not None else StreamTable()
        self.clock = clock
        self._published_load = published_load or (lambda: self.load)
        self.headroom = headroom if headroom is not None else high_priority_headroom(
            config.headroom_high, getattr(self.engine, "profile", None), self.engine.load().total_blocks)
        self.terminating = False
        self.role = Role.parse(config.role)
        self.dead = False  # the engine thread died: this instance is stopping
        self.seq = 0
        self.load: EngineLoad = self.engine.load()
        self._load_key = material(self.load)
        self.runner: EngineRunner | None = None
        self.reporter: StatusReporter | None = None
        self.info: InstanceInfo | None = None
        self.migration = None  # set in start(): services.instance.migration.MigrationManager
        self.pipeline = None  # set in start(): services.instance.kunserve.PipelineHost (KunServe)
        self.migration_rpcs = None
        self.queue = QueueBound(config.queued_tokens_bound())
        self.registered = registered if registered is not None else Registered(config.meta_store)
        self.hang: HangMonitor | None = None  # set in start()
        self.draining = False  # SIGTERM: handing the requests here over before stopping
        self.kv_events = KvEventPublisher(self.instance_id)
        # What follows each request here, step by step (serving_metrics.py; request_traces.py when tracing).
        self.observers: list = []

    # --- lifecycle --------------------------------------------------------------
    async def start(self, bound_address: str) -> None:
        host = self.config.advertise_host or self.config.host
        address = f"{host}:{bound_address.rsplit(':', 1)[1]}"
        e = self.engine
        self.info = InstanceInfo(self.instance_id, address, e.name, e.model_name, e.block_size,
                                 e.num_total_blocks, e.max_model_len, int(time.time() * 1000), e.vocab_size,
                                 no_migration=e.no_migration)
        runner = EngineRunner(self.engine, asyncio.get_running_loop(), self._on_step,
                              on_kv_events=self.kv_events.publish)
        runner.start()
        serving = None
        if self.config.metrics_port >= 0:
            from services.instance.serving_metrics import ServingMetrics

            serving = ServingMetrics(e.model_name, self.instance_id)
            self.observers.append(serving)
        trace_context = None
        if tracing.enabled():
            from services.instance.request_traces import RequestTraces

            traces = RequestTraces(self.instance_id)
            self.observers.append(traces)
            trace_context = traces.context_of
        self.attach_ports(runner, trace_context=trace_context)
        if serving is not None:
            from libs.common.metrics_server import serve_metrics

            serving.export(lambda: self.load, lambda: (self.migration.migrating_in, self.migration.migrating_out))
            serve_metrics(self.config.metrics_port, self.config.host)
        self.reporter = StatusReporter(self.config.meta_store, self.info, self.status,
                                       self.config.report_interval_s, self.config.heartbeat_s)
        self.reporter.start()
        c = self.config
        self.hang = HangMonitor(self.runner, HangLimits(c.hang_factor, c.hang_floor_s, c.hang_stop_s),
                                self._on_health)
        self.hang.start()
        log.info("instance ready", instance_id=self.instance_id, address=address, engine=e.name,
                 blocks=e.num_total_blocks, block_size=e.block_size)

    def attach_ports(self, runner, *, reporter=None, migration_config=None, trace_context=None,
                     load: Callable[[], EngineLoad] | None = None, clock: Callable[[], float] | None = None,
                     offload=None, fault=None, expire_interval_s: float | None = None, peers=None) -> None:
        """What every agent has, on its engine's ``runner`` (an EngineRunner, or
        the simulator's): the migration manager (``migration_config``, default
        the config's) with its host, RPCs and Splitwise handoffs, and KunServe's
        pipeline host. The simulator also gives its ``reporter`` (``poke()``),
        the ``load`` its migrations read, their ``clock``, ``offload``,
        ``fault`` and ``expire_interval_s``; ``peers`` (address -> migration
        peer) replaces the constructor's ``migration_peers``."""
        from services.instance.kunserve import PipelineHost
        from services.instance.migration import MigrationHost, MigrationManager
        from services.instance.migration.servicer import MigrationRpcs

        self.runner = runner
        if peers is not None:
            self._migration_peers = peers
        if reporter is not None:
            self.reporter = reporter
        host_ports = {k: v for k, v in (("trace_context", trace_context), ("clock", clock), ("offload", offload))
                      if v is not None}
        host = MigrationHost(self.instance_id, runner, self.streams, is_terminating=lambda: self.terminating,
                             load=load or (lambda: self.load), headroom=self.headroom, changed=self._poke,
                             decodes=lambda: self.role.decodes, committed_in=self._committed_in, **host_ports)
        manager_ports = {k: v for k, v in (("fault", fault), ("expire_interval_s", expire_interval_s))
                         if v is not None}
        self.migration = MigrationManager(host, migration_config or self.config.migration_config(),
                                          peers=self._migration_peers, **manager_ports)
        self.migration_rpcs = MigrationRpcs(self.migration)
        self.pipeline = PipelineHost(self.engine, runner)

    async def stop(self) -> None:
        if self.migration and not self.dead and self.exit_code == 0 and self.config.drain_timeout_s > 0:
            await self._drain()
        if self.hang:
            await self.hang.stop()
        await self.registered.close()
        self.kv_events.close()
        if self.migration:
            await self.migration.close()
        if self.pipeline:
            await self.pipeline.close()
        if self.reporter:
            await self.reporter.stop(deregister=True)
        if self.runner:
            self.runner.stop()

    def _poke(self) -> None:
        if self.reporter:
            self.reporter.poke()

    def _held(self) -> int:
        """Requests this instance still holds: queued, running, leaving."""
        return len(self.load.requests) + (self.migration.migrating_out if self.migration else 0)

    async def _drain(self) -> None:
        """SIGTERM: hand every request over by live migration first (shutdown.py)."""
        from services.instance.shutdown import drain_for_shutdown

        self.draining = self.terminating = True
        self._poke()
        if not self._held():
            return
        log.info("draining before stopping", requests=self._held(), max_s=self.config.drain_timeout_s)
        try:
            await drain_for_shutdown(self.migration, self.config.meta_store, self.instance_id,
                                     self.config.drain_timeout_s, self._held)
        except Exception as e:  # noqa: BLE001 - a failed drain still stops (the rest resume by recompute)
            log.error("shutdown drain failed", error=repr(e))

    def _on_health(self, health: Health, running_s: float) -> None:
        """The hang monitor's verdict changed (services/instance/hang.py)."""
        self._poke()
        asyncio.ensure_future(self.set_health(health is Health.STEPPING))
        if health is Health.STOPPING and not self.dead:
            self._end_all(Code.UNAVAILABLE, f"the engine of instance {self.instance_id} is stuck in a step "
                                            f"({running_s:.1f}s); resuming elsewhere")
            self.dead = True
            self.shutdown(EXIT_ENGINE_HUNG)

    def _end_all(self, code: Code, message: str) -> None:
        """End every stream with an error: their requests resume elsewhere."""
        for rid in self.streams.ids():
            stream = self.streams.get(rid)
            stream.push(Event(stream.next_index, error=(code.value, message)))
            self.streams.close(rid)

    # --- engine outputs (on the event loop) -----------------------------------------
    def _on_step(self, outputs: list[TokenOutput], load: EngineLoad | None) -> None:
        """The engine thread's step callback: the step's outputs delivered,
        then its load published (None: the engine died)."""
        self.deliver(outputs, load)
        if load is None:
            self._engine_died()
            return
        self.load = load
        self.queue.on_load()
        key = material(load)
        if key != self._load_key:  # not every step: most only add a token
            self._load_key = key
            if self.reporter:
                self.reporter.poke()

    def deliver(self, outputs: list[TokenOutput], load: EngineLoad | None = None) -> None:
        """A step's outputs to their streams (a Splitwise handoff starts at its
        request's first token) and to the observers. The simulator calls it
        at each simulated step's end and publishes the load itself."""
        for out in outputs:
            if out.error is not None:
                log.warning("request failed; the engine goes on", request_id=out.request_id, code=out.error[0],
                            error=out.error[1])
        self.streams.deliver(outputs, self.migration.handoffs.on_output if self.migration is not None else None)
        for o in self.observers:
            o.on_step(outputs, load)

    def _engine_died(self) -> None:
        """NOTE: a dead engine is a dead instance. Every stream ends with
        UNAVAILABLE, so the frontend resumes its request elsewhere by
        recompute; then the instance stops: health NOT_SERVING, deregistered
        from the meta store (dispatch no longer sees it), exit status
        EXIT_ENGINE_DIED for the launcher or compose to act on."""
        if self.dead:
            return
        self.dead = True
        error = self.runner.error if self.runner else None
        log.error("engine died; stopping this instance so that its requests resume elsewhere", error=repr(error))
        self._end_all(Code.UNAVAILABLE, f"the engine of instance {self.instance_id} died: {error!r}")
        self.shutdown(EXIT_ENGINE_DIED)

    def _end_stream(self, request_id: str, reason: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.push(Event(stream.next_index, None, reason))
            self.streams.close(request_id)

    # --- serving ----------------------------------------------------------------
    async def generate(self, order: GenerateOrder) -> AsyncIterator[StreamEvent]:
        """Run a request here and stream what it produces (StreamEvents);
        a bad order, a full queue or a dead engine raise FerryErrors."""
        stream = await self.admit(order)
        rid, resume = stream.request_id, order.resume_token_ids
        try:
            async for f in serve_stream(self.streams, stream, len(resume), len(order.prompt_token_ids),
                                        order.flush_interval_ms, self._client_gone):
                yield f
        finally:
            self._left(rid)

    async def admit(self, order: GenerateOrder):
        """Generate up to its stream: the order checked, admitted and in the
        engine, its stream open (returned). The simulator's client follows
        the stream by the step delivery's observers instead of reading it."""
        if self.dead:
            raise Unavailable(f"the engine of instance {self.instance_id} is not running")
        rid = order.request_id or uuid.uuid4().hex
        problem = request_id_problem(rid)
        if problem:
            raise InvalidArgument(problem, param="request_id")
        if rid in self.streams and not await self.migration.dest.drop_unattached(rid):
            raise InvalidArgument(f"request id {rid!r} is already running here")
        if not order.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids is empty")
        problem = sampling_problem(order.sampling)
        if problem:
            raise InvalidArgument(problem, param="sampling")
        target = order.handoff
        if target is not None and target[0] and not target[1]:
            raise InvalidArgument("handoff names an instance without its address", param="handoff")
        handoff = target if target is not None and target[0] and target[0] != self.instance_id else None
        if handoff is not None:
            await self.registered.check(handoff[0], handoff[1], "handoff target")
        resume = order.resume_token_ids
        n_tokens = len(order.prompt_token_ids) + len(resume)
        refused = self.queue.admit(self.load, n_tokens, resumed=bool(resume))
        if refused:
            raise ResourceExhausted(refused)
        ereq = EngineRequest(rid, order.prompt_token_ids, order.sampling, order.priority, self.clock(), resume,
                             program_id=order.program_id,
                             trace_headers=tracing.headers() if self.engine.traces_requests else {})
        stream = self.streams.open(rid, next_index=len(resume))
        try:
            await self._enter(ereq, handoff, n_tokens)
        except BaseException:
            self.queue.dropped(n_tokens)
            self.streams.close(rid)
            raise
        self.queue.added(n_tokens)
        for o in self.observers:
            o.arrived(rid, len(order.prompt_token_ids), len(resume))
        return stream

    async def _enter(self, ereq: EngineRequest, handoff: tuple[str, str] | None, n_tokens: int) -> None:
        """Into the engine: directly, or (Splitwise) with the plan of its
        handoff to the decode instance the scheduler chose, planned before the
        engine sees the request so that its first token finds the plan."""
        if failpoints.enabled("instance.lose_requests"):  # tests: a request that never runs
            return
        if handoff is None:
            try:
                await self.runner.call(self.engine.add_request, ereq)
            except EngineBroken as e:
                raise Unavailable(str(e)) from None
            except EngineError as e:
                raise InvalidArgument(str(e)) from None
            return
        plan = self.migration.handoffs.plan(ereq.request_id, handoff[0], handoff[1], n_tokens)
        try:
            await self.migration.handoffs.add(ereq, plan)  # a per-layer handoff starts with it
        except EngineBroken as e:
            self.migration.handoffs.forget(ereq.request_id)
            raise Unavailable(str(e)) from None
        except EngineError as e:
            self.migration.handoffs.forget(ereq.request_id)
            raise InvalidArgument(str(e)) from None
        except BaseException:
            self.migration.handoffs.forget(ereq.request_id)
            raise

    async def attach(self, request_id: str, from_index: int, flush_interval_ms: int = 0) -> AsyncIterator[StreamEvent]:
        """The stream of a request that migrated in, from ``from_index``."""
        served = False
        try:
            async for f in serve_attached(self.streams, request_id, from_index, flush_interval_ms, self._client_gone):
                served = True
                yield f
        finally:
            if served:  # (an attach refused for a stream already followed ends nothing)
                self._left(request_id)

    def _committed_in(self, state) -> None:
        for o in self.observers:
            o.committed_in(state)

    def _left(self, request_id: str) -> None:
        """The request's stream here ended (finished, moved on, aborted, failed)."""
        for o in self.observers:
            o.left(request_id)

    def _client_gone(self, request_id: str) -> None:
        """The client left before the stream's end: abort and free the blocks."""
        self.migration.handoffs.forget(request_id)
        self.runner.submit(self.engine.abort_request, request_id)
        log.info("client gone; request aborted", request_id=request_id)

    async def abort(self, request_id: str) -> bool:
        self.migration.handoffs.forget(request_id)
        found = await self.runner.call(self.engine.abort_request, request_id)
        self._end_stream(request_id, "abort")
        return bool(found)

    def set_terminating(self, terminating: bool) -> None:
        self.terminating = terminating
        log.info("terminating mark", terminating=terminating)
        self._poke()

    async def set_role(self, role: Role, drain_to: list[tuple[str, str]]) -> tuple[Role, int]:
        """Splitwise: what this instance runs from now on. Becoming prefill
        drains the requests decoding here to ``drain_to`` (instance, address)
        by live migration. Returns the previous role and how many drain."""
        if any(iid and not address for iid, address in drain_to):
            raise InvalidArgument("drain_to names an instance without its address", param="drain_to")
        targets = [(iid, address) for iid, address in drain_to if iid and iid != self.instance_id]
        for iid, address in targets:
            await self.registered.check(iid, address, "drain_to instance")
        draining = 0
        if role is Role.PREFILL:
            if self.engine.no_migration:
                raise FailedPrecondition(f"this instance cannot hand requests over: {self.engine.no_migration}")
            ready, waiting = self.migration.decoding_here()
            if (ready or waiting) and not targets:
                raise FailedPrecondition(f"{len(ready) + waiting} requests would decode here and no drain_to "
                                         "instance was given")
            draining = len(ready)
        previous, self.role = self.role, role
        log.info("role changed", role=role.value, previous=previous.value, draining=draining)
        self._poke()
        if role is Role.PREFILL and targets:
            self.migration.start_drain(targets, still=lambda: self.role is Role.PREFILL)
        return previous, draining

    async def check_integrity(self, with_cached_hashes: bool = False) -> Integrity:
        def check():
            err = ""
            try:
                self.engine.check_integrity()
            except AssertionError as e:
                err = str(e) or "integrity check failed"
            hashes = self.engine.cached_hashes() if with_cached_hashes else []
            return err, self.engine.num_free_blocks, self.engine.load(), hashes

        err, free, load, hashes = await self.runner.call(check)
        return Integrity(err, free, self.engine.num_total_blocks, len(load.requests),
                         len(self.migration.reservations) if self.migration else 0, hashes)

    async def kv_events_stream(self) -> AsyncIterator[KvSnapshot | KvEventBatch]:
        """The prefix cache's events: a snapshot, then each step's batch."""
        q = self.kv_events.subscribe()
        try:
            while (item := await q.get()) is not None:
                yield item
        finally:
            self.kv_events.unsubscribe(q)

    async def authorize_destination(self, instance_id: str, address: str) -> None:
        """A migration's destination must be registered at that address (the
        cluster token is not root: services/instance/registered.py)."""
        await self.registered.check(instance_id, address)

    def migrations(self):
        """Both sides of live migration (services/instance/migration/servicer.py)."""
        if self.migration is None:
            raise FailedPrecondition("migration is not available on this instance")
        return self.migration_rpcs

    def pipelines(self):
        """KunServe's pipeline host (services/instance/kunserve.py)."""
        if self.pipeline is None:
            raise FailedPrecondition("this instance is not serving yet")
        return self.pipeline

    # --- status --------------------------------------------------------------
    def status(self) -> InstanceStatus | None:
        """This instance's status report (None only in the simulator, while the load cannot be read)."""
        load = self._published_load()
        if load is None:
            return None
        self.seq += 1
        m = self.migration
        return instance_status(self.instance_id, self.seq, self.clock(), load, self.headroom,
                               self.terminating, m.migrating_in if m else 0, m.migrating_out if m else 0,
                               engine_steps=self.runner.steps if self.runner else 0, role=self.role,
                               unschedulable=self.hang is not None and self.hang.health is not Health.STEPPING)
