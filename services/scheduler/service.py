"""The global scheduler: Dispatch, the cluster view, terminating marks, and
(when the policy migrates) the rescheduling loop.

Splitwise (prefill and decode instances): Dispatch makes both choices at once
(libs/common/policies/phases.place) and answers the prefill instance and the
decode instance; the frontend passes the decode instance on with the request
and the prefill instance hands the request over when its prompt is done. So
the handoff never waits for a scheduler round trip, and a scheduler that is
down (frontend bypass) does not stop it: the bypass places the same way."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc

from libs.pb import scheduler_pb2 as pb
from libs.pb import scheduler_pb2_grpc as pb_grpc
from libs.common import convert, tracing
from libs.common.cluster_view import ClusterView
from libs.common.config import CommonConfig, opt
from libs.common.errors import Code, FailedPrecondition, FerryError, NotFound, Unavailable, abort_with
from libs.common.logging import get_logger
from libs.common.policies import POLICY_NAMES, Dispatcher, DispatchRequest, Policy, get
from libs.common.policies.index import DispatchIndex
from libs.common.instance_client import GrpcInstanceClients
from libs.common.policies.base import affine
from libs.common.policies.phases import Placement, count_placed, place, uncounted
from libs.common.programs import ProgramLedger
from libs.common.server import Service
from libs.common.types import Priority, Role
from services.scheduler import metrics
from services.scheduler.policies import PromptHashes

log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig(CommonConfig):
    port: int = opt(7001, "port to listen on", min=0, max=65535)
    meta_store: str = opt("127.0.0.1:7000", "meta store address host:port")
    dispatch: str = opt("llumnix", "dispatch policy (libs/common/policies)", choices=POLICY_NAMES)
    migrate_interval_s: float = opt(0.1, "rescheduling loop interval (s)", min=0.005)
    # Freeness is free blocks per running request. 10 / 20 are the values of the
    # measured sim runs in docs/results (16 x llama-7b-a10, 851 blocks each): at
    # 20, an instance running 20 requests with 400 free blocks can receive; the
    # earlier 60 admitted only near-idle instances.
    migrate_out_threshold: float | None = opt(None, "instances with freeness below this are migration sources "
                                                    "(default: the policy's, 10)")
    migrate_in_threshold: float | None = opt(None, "instances with freeness above this are destinations "
                                                   "(default: the policy's, 20)")
    migration: bool = opt(True, "run the rescheduling loop (for policies that migrate)")
    dispatch_pending: bool = opt(True, "count a dispatched request against its instance until a status report "
                                       "lists it (off: dispatch reads the reports alone, as Llumnix's first "
                                       "release did; a sensitivity flag)")
    metrics_port: int = opt(-1, "Prometheus /metrics port (-1 = off, 0 = any)", min=-1)
    prefix_index: bool = opt(True, "keep the cluster-wide prefix index: follow every instance's KV events "
                                   "(which instance holds which block hash)")
    # Launcher and auto-scaling (services/scheduler/launcher.py, autoscaler.py).
    launch_args: str = opt("", "instance arguments (shell-quoted) for instances the scheduler launches; "
                               "empty = no launcher")
    launch_log_dir: str = opt("", "directory for the logs of launched instances (default: inherit)")
    autoscale: bool = opt(False, "auto-scale instances through the launcher (needs --launch-args)")
    scale_out_below: float = opt(10.0, "auto-scaling: launch when mean normal freeness stays below this")
    scale_in_above: float = opt(60.0, "auto-scaling: drain and stop one when it stays above this")
    scale_window_s: float = opt(10.0, "auto-scaling: averaging window (s)", min=0.0)
    scale_cooldown_s: float = opt(10.0, "auto-scaling: least time between two actions (s)", min=0.0)
    min_instances: int = opt(1, "auto-scaling: fewest live instances", min=0)
    max_instances: int = opt(8, "auto-scaling: most live instances", min=1)
    scale_out_max_launch: int = opt(1, "auto-scaling: most instances one scale-out launches, sized by the "
                                       "freeness shortfall (1: one per action, as Llumnix)", min=1)
    autoscale_interval_s: float = opt(0.5, "auto-scaling: sampling interval (s)", min=0.01)
    launcher: str = opt("", "how instances are launched: local (processes on this host, from --launch-args) or "
                            "kubernetes (scales --k8s-statefulset); empty = local when --launch-args is given",
                        choices=("", "local", "kubernetes"))
    k8s_statefulset: str = opt("ferry-instance", "kubernetes launcher: the instances' StatefulSet")
    k8s_namespace: str = opt("", "kubernetes launcher: its namespace (default: this pod's)")
    # A replicated control plane (services/scheduler/leader.py, state.py).
    etcd: str = opt("", "etcd endpoints host:port[,host:port...]: schedulers elect a leader, which alone runs "
                        "migration, auto-scaling and KunServe, and hands its state over (empty = sole scheduler)")
    etcd_prefix: str = opt("/ferry", "etcd: key prefix of this cluster")
    leader_ttl_s: float = opt(1.0, "etcd: leadership lease (s, whole seconds); a standby takes over within about "
                                   "this long after the leader dies", min=1.0)
    scheduler_id: str = opt("", "this scheduler's name in the leader election (default: random)")
    # KunServe (services/scheduler/kunserve.py, docs/kunserve.md).
    kunserve: bool = opt(False, "KunServe: under KV memory throttling, drop layers into buddy groups that serve as "
                                "pipelines; restore when pressure ends (native instances)")
    kunserve_layers: int = opt(0, "KunServe: the model's layer count (instances do not report it)", min=0)
    kunserve_layer_blocks: int = opt(0, "KunServe: one layer's parameter memory in KV blocks (SmolLM2, 16-token "
                                        "blocks: 19 in fp32, 38 in bf16 with prepacked weights)", min=0)
    kunserve_min_group_s: float = opt(5.0, "KunServe: a group lasts at least this long", min=0.0)
    kunserve_restore_margin: float = opt(0.2, "KunServe: restore once each member's requirement fits (1 - this) "
                                              "of its own memory", min=0.0, max=0.99)
    kunserve_max_group_size: int = opt(0, "KunServe: the most members a merge makes a group of (0: no bound; 2: "
                                          "no merges, advised on native instances: docs/kunserve.md)", min=0)
    kunserve_pause_exchange: bool = opt(False, "KunServe: members joining a group move their running requests' KV "
                                               "in a pause before their next step, instead of live (remote "
                                               "attention meanwhile)")

    @property
    def policy(self) -> Policy:
        return get(self.dispatch)

    @property
    def out_threshold(self) -> float:
        """The migration-source threshold in force: the flag, else the policy's."""
        t = self.migrate_out_threshold
        return self.policy.migrate_out_threshold if t is None else t

    @property
    def in_threshold(self) -> float:
        t = self.migrate_in_threshold
        return self.policy.migrate_in_threshold if t is None else t


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(self, svc: "SchedulerService"):
        self.svc = svc
        self._unrecorded: list = []  # DispatchStream's dispatch spans to record (tracing on)

    async def Dispatch(self, request, context):
        try:
            return self._timed_dispatch(request)
        except FerryError as e:
            await abort_with(context, e)

    async def DispatchStream(self, request_iterator, context):
        """Dispatch's decision for each request of the stream, in order;
        one that cannot be placed gets its error in the reply."""
        async for request in request_iterator:
            t0 = time.time_ns()
            try:
                reply = self._timed_dispatch(request, traced=False)
            except FerryError as e:
                reply = pb.DispatchReply(error_code=e.code.value, error_message=e.message)
            except Exception as e:  # (one request's failure must not end the others' stream)
                log.exception("dispatch failed", request_id=request.request_id)
                reply = pb.DispatchReply(error_code=Code.INTERNAL.value, error_message=f"dispatch failed: {e}")
            reply.request_id = request.request_id
            yield reply
            if request.traceparent and tracing.enabled():  # after the reply, off the request's way
                self._later(request, reply, t0)

    def _timed_dispatch(self, request, traced: bool = True) -> pb.DispatchReply:
        """_dispatch, timed and counted by outcome (services/scheduler/metrics.py);
        with tracing on (``traced``: the call's context; DispatchStream records
        its own after each reply), its span once decided."""
        t0 = time.perf_counter()
        t0_ns = time.time_ns()
        outcome = "error"
        try:
            reply = self._dispatch(request)
            outcome = "placed"
            if traced and tracing.enabled():
                self._record(request, reply, t0_ns, None)
            return reply
        except Unavailable:
            outcome = "unavailable"
            raise
        finally:
            metrics.DISPATCH_SECONDS.observe(time.perf_counter() - t0)
            metrics.DISPATCHES.labels(outcome).inc()

    def _later(self, request, reply, t0_ns: int) -> None:
        """A stream's dispatch span, recorded a little later with the others
        of that moment (not between this reply and the next request)."""
        end = time.time_ns()
        if not self._unrecorded:
            asyncio.get_running_loop().call_later(0.05, self._record_all)
        self._unrecorded.append((request, reply, t0_ns, end))

    def _record_all(self) -> None:
        todo, self._unrecorded = self._unrecorded, []
        for request, reply, t0_ns, end in todo:
            self._record(request, reply, t0_ns, tracing.from_traceparent(request.traceparent), end)

    def _record(self, request, reply, t0_ns: int, parent, end_ns: int | None = None) -> None:
        """The dispatch's span (of the past): the policy, the candidates as
        the view has them (the freest first), the choice."""
        views = sorted(self.svc.view.views(), key=lambda v: -v.status.freeness)
        tracing.record("ferry.scheduler.dispatch", t0_ns, end_ns or time.time_ns(), {
            "ferry.request_id": request.request_id, "ferry.prompt_tokens": request.num_prompt_tokens,
            "ferry.policy": reply.policy, "ferry.candidates": len(views),
            "ferry.candidate_freeness": [f"{v.instance_id}={v.status.freeness:.1f}" for v in views[:8]],
            "ferry.excluded": list(request.exclude_instance_ids), "ferry.choice": reply.instance_id,
            "ferry.decode_choice": reply.decode_instance_id, "ferry.error": reply.error_message or None},
            context=parent)

    def _dispatch(self, request) -> pb.DispatchReply:
        """Place one request (raises FerryError where it cannot be placed)."""
        view = self.svc.view
        if not view.synced.is_set():
            raise Unavailable("scheduler has no cluster view yet")
        req = DispatchRequest(request.request_id, request.num_prompt_tokens, convert.priority_from_pb(request.priority),
                              frozenset(request.exclude_instance_ids), affinity=request.affinity_instance_id,
                              program_id=request.program_id,
                              program_turn=self.svc.programs.turns_before(request.program_id))
        if self.svc.dispatcher.policy.uses_prefix and request.block_hashes:
            req = dataclasses.replace(req, prefix_blocks=len(request.block_hashes),
                                      hits=self.svc.prefix_hits(list(request.block_hashes), request.block_size))
            if self.svc.dispatcher.policy.pairs_by_move_cost:
                self.svc.prompt_hashes.put(request.request_id, request.block_hashes)
        placed = self.svc.place(req)
        if placed is None:
            raise Unavailable("no live instance to dispatch to")
        hit = count_placed(placed, req, lambda iid: view.records[iid].info.block_size, request.block_size,
                           view.add_pending if self.svc.config.dispatch_pending else uncounted)
        rec = view.records[placed.prefill]
        if request.program_id:
            cached = ProgramLedger.cached_tokens(request.num_prompt_tokens, hit, rec.info.block_size)
            s = self.svc.programs.record(request.program_id, request.num_prompt_tokens, cached, time.time())
            metrics.program_turn(s.turns, request.num_prompt_tokens, cached)
        run = req.priority if self.svc.dispatcher.uses_priorities else Priority.NORMAL
        reply = pb.DispatchReply(instance_id=placed.prefill, address=rec.info.address,
                                 policy=self.svc.dispatcher.name, run_priority=int(run))
        if placed.decode is not None:
            reply.decode_instance_id, reply.decode_address = placed.decode, view.records[placed.decode].info.address
        return reply

    async def GetClusterView(self, request, context):
        return pb.ClusterViewReply(
            instances=[convert.record_to_pb(r) for r in self.svc.view.records.values()],
            dispatch_policy=self.svc.dispatcher.name,
            migrations_ordered=self.svc.migrations_ordered,
        )

    async def SetTerminating(self, request, context):
        address = self.svc.view.address(request.instance_id)
        if address is None:
            await abort_with(context, NotFound(f"unknown instance {request.instance_id!r}"))
        try:
            await self.svc.clients(request.instance_id, address).set_terminating(request.terminating)
        except FerryError as e:
            await abort_with(context, FailedPrecondition(f"instance unreachable: {e}"))
        return pb.SetTerminatingReply(ok=True)


    async def GetPrefixIndex(self, request, context):
        kv = self.svc.kv_index
        reply = pb.PrefixIndexReply()
        if kv is None:
            return reply
        idx = kv.index
        for iid in sorted(set(idx.instances()) | set(self.svc.view.records)):
            hashes = idx.hashes_of(iid)
            reply.instances.append(pb.PrefixIndexReply.Instance(
                instance_id=iid, seq=idx.seq_of(iid) or 0, synced=iid in kv.synced, num_blocks=len(hashes),
                block_hashes=sorted(hashes) if request.with_hashes else []))
        reply.num_entries = idx.num_entries
        return reply

    async def SetRole(self, request, context):
        """Change an instance's role (Splitwise's mixed pool). Becoming
        prefill, its decoding requests drain to the other instances that
        decode, freest first."""
        view = self.svc.view
        role = convert.role_from_pb(request.role)
        address = view.address(request.instance_id)
        if address is None:
            raise NotFound(f"unknown instance {request.instance_id!r}")
        drain_to = []
        if role is Role.PREFILL:
            others = sorted((v for v in view.views() if v.instance_id != request.instance_id and v.schedulable
                             and v.status.role.decodes), key=lambda v: (-v.status.freeness, v.instance_id))
            if not others:
                raise FailedPrecondition(f"no other instance decodes: {request.instance_id} cannot become prefill")
            drain_to = [(v.instance_id, view.address(v.instance_id)) for v in others]
        try:
            previous, draining = await self.svc.clients(request.instance_id, address).set_role(role, drain_to)
        except FerryError as e:
            raise FailedPrecondition(f"instance {request.instance_id} did not change role: "
                                     f"{e.code.name}: {e}") from None
        log.info("role change", instance_id=request.instance_id, role=role.value, draining=draining)
        return pb.SetInstanceRoleReply(previous=convert.role_to_pb(previous), draining=draining)


class SchedulerService(Service):
    name = "scheduler"
    service_names = ("ferry.v1.Scheduler",)

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.dispatcher = Dispatcher(config.policy)
        self.view = ClusterView(config.meta_store)
        self.clients = GrpcInstanceClients()  # how its loops and RPCs reach the instances
        self.view.listeners.append(self._forget_gone)
        self.migrations_ordered = 0
        self.programs = ProgramLedger()  # per program: turns, prompt tokens cached / computed (libs/common/programs.py)
        self.rescheduler = None
        self.launcher = None
        self.autoscaler = None
        self.kunserve = None
        self.kv_index = None  # libs/common/kv_index.py: the prefix index and its streams (every scheduler)
        self.prompt_hashes = PromptHashes()  # of recent dispatches, for Policy.pairs_by_move_cost
        # Every scheduler dispatches; the leader alone runs the loops below
        # (services/scheduler/leader.py), with a previous leader's state.
        self.leadership = None
        self.state = None

        # Policies scored by per-instance terms dispatch through an index that
        # recomputes only the instances that changed (policies/index.py).
        self.index = DispatchIndex(config.policy) if config.policy.dispatch_terms else None
        self._stale: set[str] = set()
        if self.index is not None:
            self.view.listeners.append(self._stale.add)

    def place(self, req: DispatchRequest) -> Placement | None:
        """Dispatch's decision: the index where it serves (every instance
        mixed), else the policy over the whole view (Splitwise's two steps)."""
        if req.affinity:
            near = affine(self.view.views(), req)
            if near is not None:
                return Placement(near)
        if self.index is not None:
            self.view.refresh()
            for iid in self._stale:
                self.index.update(iid, self.view.view_of(iid))
            self._stale.clear()
            if self.index.split == 0:
                iid = self.index.choose(req)
                return None if iid is None else Placement(iid)
        return place(self.dispatcher, self.view.views(), req)

    def held_prefix(self, block_hashes: tuple) -> dict[str, int]:
        """Per instance, how many of the first ``block_hashes`` its cache
        holds (the prefix index: instances whose stream is not synced hold none)."""
        if self.kv_index is None:
            return {}
        return self.kv_index.index.match(list(block_hashes))

    def prefix_hits(self, block_hashes: list[int], block_size: int) -> dict[str, int]:
        """Per instance, how many of the first ``block_hashes`` (hashed at
        ``block_size`` tokens a block) its prefix cache holds, from the
        prefix index (instances whose stream is not synced are not in it;
        instances of another block size hold none of these hashes)."""
        return {} if self.kv_index is None else self.kv_index.hits(block_hashes, block_size)

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_SchedulerServicer_to_server(SchedulerServicer(self), server)

    async def start(self, bound_address: str) -> None:
        c = self.config
        if c.autoscale and not self._launcher_kind():
            raise ValueError("--autoscale needs a launcher (--launch-args, or --launcher kubernetes)")
        if c.kunserve and not (c.kunserve_layers and c.kunserve_layer_blocks):
            raise ValueError("--kunserve needs --kunserve-layers and --kunserve-layer-blocks")
        from services.scheduler.leader import EtcdLeadership, SoleLeader
        from services.scheduler.state import EtcdState, MemoryState

        self.view.start()
        if c.metrics_port >= 0:
            from libs.common.metrics_server import serve_metrics

            metrics.export(self)
            serve_metrics(c.metrics_port, c.host)
        if c.prefix_index:
            from libs.common.kv_index import KvIndexWatcher

            self.kv_index = KvIndexWatcher(self.view)
            self.kv_index.start()
        if c.etcd:
            self.leadership = EtcdLeadership(c.etcd, c.etcd_prefix, ttl_s=c.leader_ttl_s,
                                             scheduler_id=c.scheduler_id, address=bound_address)
            self.state = EtcdState(self.leadership)
        else:
            self.leadership, self.state = SoleLeader(), MemoryState()
        await self.leadership.start(self._lead, self._follow)

    def _forget_gone(self, instance_id: str) -> None:
        """A view listener: an instance the view dropped loses its kept channel."""
        if instance_id not in self.view.records:
            self.clients.forget(instance_id)

    def _count_order(self) -> None:
        self.migrations_ordered += 1

    def _launcher_kind(self) -> str:
        return self.config.launcher or ("local" if self.config.launch_args else "")

    async def _lead(self) -> None:
        """Elected: start the singleton loops, taking over what the previous
        leader left (instances it launched, drains, KunServe groups)."""
        c = self.config
        if c.migration and self.dispatcher.migrates:
            from services.scheduler.rescheduler import Rescheduler

            self.rescheduler = Rescheduler(self.view, c, on_order=self._count_order, prompt_hashes=self.prompt_hashes,
                                           held_prefix=self.held_prefix, clients=self.clients)
            self.rescheduler.start()
        kind = self._launcher_kind()
        if kind == "local":
            from services.scheduler.launcher import LocalProcessLauncher

            self.launcher = LocalProcessLauncher(c.meta_store, c.launch_args, log_dir=c.launch_log_dir,
                                                 state=self.state, survive_scheduler=bool(c.etcd))
        elif kind == "kubernetes":
            from services.scheduler.k8s_launcher import KubernetesLauncher

            self.launcher = KubernetesLauncher(c.k8s_statefulset, c.k8s_namespace, serving=self._serving)
        if self.launcher is not None:
            await self.launcher.adopt()
        if c.autoscale:
            from services.scheduler.autoscaler import AutoscalePolicy, Autoscaler

            self.autoscaler = Autoscaler(self.view, self.launcher, AutoscalePolicy(
                c.scale_out_below, c.scale_in_above, c.scale_window_s, c.min_instances, c.max_instances,
                c.scale_cooldown_s, max_launch=c.scale_out_max_launch), interval_s=c.autoscale_interval_s,
                state=self.state, clients=self.clients)
            await self.autoscaler.adopt()
            self.autoscaler.start()
        if c.kunserve:
            from services.scheduler.kunserve import KunServeConfig, KunServeLoop

            self.kunserve = KunServeLoop(self.view, KunServeConfig(
                c.kunserve_layers, c.kunserve_layer_blocks, min_group_s=c.kunserve_min_group_s,
                restore_margin=c.kunserve_restore_margin, pause_exchange=c.kunserve_pause_exchange,
                max_group_size=c.kunserve_max_group_size or None),
                clients=self.clients, state=self.state)
            await self.kunserve.adopt()
            self.kunserve.start()

    async def _follow(self) -> None:
        """Deposed (or resigning): stop the loops; the instances launched stay
        up for the next leader."""
        await self._stop_loops(close_launcher=False)

    def _serving(self, instance_id: str) -> bool:
        rec = self.view.records.get(instance_id)
        return rec is not None and rec.status is not None

    async def _stop_loops(self, close_launcher: bool) -> None:
        if self.kunserve is not None:
            await self.kunserve.stop()
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if self.launcher is not None:
            if close_launcher:
                await self.launcher.close()
            else:
                self.launcher.release()
        if self.rescheduler is not None:
            await self.rescheduler.stop()
        self.kunserve = self.autoscaler = self.launcher = self.rescheduler = None

    async def stop(self) -> None:
        if self.leadership is not None:
            await self.leadership.stop()  # etcd: resigns; the deposed hook stopped the loops
        await self._stop_loops(close_launcher=True)
        if self.kv_index is not None:
            await self.kv_index.stop()
        await self.clients.close()
        await self.view.stop()
