"""The instance agent ("llumlet"): serves Generate/Attach/Abort over gRPC,
reports its load to the meta store, and hosts both sides of live migration."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import grpc

from libs.pb import instance_pb2 as pb
from libs.pb import instance_pb2_grpc as pb_grpc
from libs.common import convert, failpoints
from libs.common.config import CommonConfig, ConfigError, opt
from libs.common.cpus import parse_cpus
from libs.common.errors import (
    Code,
    FailedPrecondition,
    FerryError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    abort_with,
)
from libs.common.kv_events import KvSnapshot
from libs.common.logging import get_logger
from libs.common.server import Service
from libs.common.types import InstanceInfo, InstanceStatus, Role, TokenOutput
from services.instance.engine import ENGINES, create_engine
from libs.common.validation import request_id_problem
from services.instance.admission import QueueBound
from services.instance.engine.base import EngineBroken, EngineConfig, EngineError, EngineLoad, EngineRequest
from services.instance.hang import HangLimits, HangMonitor, Health
from services.instance.registered import Registered
from services.instance.kv_events import KvEventPublisher
from services.instance.reporter import StatusReporter
from services.instance.runner import EngineRunner
from services.instance.status import high_priority_headroom, instance_status, material
from services.instance.streams import Event, StreamTable

log = get_logger(__name__)

# Exit status of an instance whose engine died (the launcher, ferry up and
# compose see a crash; its requests resume elsewhere by recompute).
EXIT_ENGINE_DIED = 3
EXIT_ENGINE_HUNG = 4  # a step ran past --hang-stop-s (services/instance/hang.py)


@dataclasses.dataclass(frozen=True)
class InstanceConfig(CommonConfig):
    port: int = opt(0, "port to listen on (0 = any free port)", min=0, max=65535)
    instance_id: str = opt("", "instance id (default: random)")
    advertise_host: str = opt("", "host other services use to reach this one (default: --host)")
    meta_store: str = opt("127.0.0.1:7000", "meta store address host:port")
    engine: str = opt("fake", "engine", choices=tuple(ENGINES))
    role: str = opt("mixed", "Splitwise role: mixed runs requests from prompt to end; prefill runs prompts and hands "
                    "each request's KV to the decode instance the scheduler chose; decode takes handed-off requests "
                    "(and any the scheduler sends when no prefill instance can)",
                    choices=tuple(r.value for r in Role))
    model: str = opt("smollm2", "model name or Hugging Face directory (native, vllm; vllm also takes hub names)")
    num_blocks: int | None = opt(None, "KV cache blocks (default: from --kv-cache-gb or the engine)", min=1)
    kv_cache_gb: float | None = opt(None, "KV cache memory budget in GiB", min=0.001)
    block_size: int | None = opt(None, "tokens per KV block (default: 16; 32 on CPU for vllm, and for native "
                                 "in bf16 with the vllm extra: vLLM's CPU attention needs a multiple of 32)",
                                 min=1)
    max_num_seqs: int = opt(256, "most requests in a running batch", min=1)
    max_num_batched_tokens: int = opt(2048, "token budget per step (chunked prefill)", min=1)
    max_model_len: int | None = opt(None, "context length (default: the model's)", min=16)
    device: str = opt("cpu", "torch device (native engine)")
    dtype: str = opt("auto", "weights/KV dtype (native; auto = bf16 where the CPU or GPU has it, else fp32)",
                     choices=("auto", "float32", "bfloat16", "float16"))
    torch_threads: int = opt(0, "native: torch intra-op threads (0 = torch's default, one per core); set 1 "
                             "when several instances share a machine's cores", min=0)
    cpus: str = opt("", "pin this instance to these CPU cores, e.g. '0' or '0-3,8' (default: any core); "
                    "`ferry up --pin-cores` gives each instance its own share")
    token_delay_ms: float = opt(10.0, "fake engine: time per step (ms)", min=0.0)
    profile: str = opt("llama-7b-a10", "sim engine: latency profile name or JSON path")
    seed: int = opt(0, "engine seed", min=0)
    headroom_high: int | None = opt(None, "virtual-usage headroom (blocks) for high-priority requests (default: "
                                    "derived from the sim profile: the memory that keeps one decoding at its ideal "
                                    "speed; 0 for engines without a profile)", min=0)
    report_interval_s: float = opt(0.05, "least time between two status reports", min=0.0)
    heartbeat_s: float = opt(0.5, "status report at least this often", min=0.01)
    metrics_port: int = opt(-1, "Prometheus /metrics port (-1 = off, 0 = any)", min=-1)
    migration_max_stages: int = opt(4, "migration: most pre-copy stages before the last one", min=0)
    migration_last_stage_max_blocks: int = opt(2, "migration: go to the last stage at this many uncopied blocks",
                                               min=0)
    migration_chunk_mb: float = opt(4.0, "migration: KV transfer chunk size (MiB)", min=0.01)
    migration_precopy_chunk_mb: float = opt(1.0, "migration: chunk size of the pre-copy stages (MiB)", min=0.01)
    migration_copy_duty: float = opt(0.25, "migration: most fraction of wall time a pre-copy stage spends "
                                     "copying (1 = unpaced)", min=0.01, max=1.0)
    migration_join_hold_ms: float = opt(20.0, "migration: after an incoming migration's last pre-allocation, start "
                                        "no step for up to this long unless its commit comes first, so that the "
                                        "request joins the next step (0 = off)", min=0.0)
    migration_join_notice: bool = opt(True, "migration: before suspending a request, tell the destination when "
                                      "its commit should come, so that it starts no step the request would wait "
                                      "for (it holds its boundary instead, at most half a step)")
    migration_shared_kv: bool = opt(True, "migration: keep the KV cache (fake, native on CPU) in shared memory; "
                                    "a destination on this host that can map it copies the blocks straight from "
                                    "it, so the source sends block ids instead of bytes (else bytes over gRPC)")
    migration_fuse_last_stage: bool = opt(True, "migration: when the destination maps this instance's shared KV "
                                          "cache, send the last stage's block ids with the commit (one round trip "
                                          "after the suspend instead of three)")
    migration_kv_staging: bool = opt(True, "migration (native on CUDA): copy KV blocks on a side stream through "
                                     "pinned host buffers, beside the engine's steps (else on the engine's stream "
                                     "through pageable memory, queued behind the step in flight)")
    max_migrate_out: int = opt(2, "migration: concurrent migrations out of this instance", min=1)
    max_migrate_out_per_dest: int = opt(2, "migration: concurrent migrations out of this instance to one "
                                        "destination", min=1)
    max_migrate_in: int = opt(2, "migration: concurrent migrations into this instance", min=1)
    max_handoff_in: int = opt(16, "Splitwise: concurrent prefill->decode handoffs into this instance", min=1)
    handoff_per_layer_threshold: int = opt(0, "Splitwise: prompts at least this long are planned as per-layer "
                                           "handoffs: their KV streams layer by layer while the prompt computes "
                                           "(0 = always serialized)", min=0)
    kunserve_exchange_mb: float = opt(16.0, "KunServe (native): KV a live exchange hands the pipeline peers "
                                      "between two steps, MiB (at least one request a step; the others "
                                      "attend here meanwhile)", min=0.0)
    migration_deadline_ms: int = opt(3000, "migration: a reservation not renewed for this long is freed", min=50)
    max_queued_tokens: int | None = opt(None, "refuse new requests (RESOURCE_EXHAUSTED: the frontend tries another "
                                        "instance, else 429) while this many prompt tokens wait for their first "
                                        "step (default: 4 x --max-num-batched-tokens, at least 8192; 0 = no bound)", min=0)
    drain_timeout_s: float = opt(60.0, "on SIGTERM: migrate the requests here to other instances for up to this "
                                 "long before stopping (what is left resumes elsewhere by recompute)", min=0.0)
    hang_factor: float = opt(2.0, "an engine step running past this many times the expected step time (the longest "
                             "recent one) marks the instance unschedulable and NOT_SERVING", min=1.0)
    hang_floor_s: float = opt(0.5, "... and past this long in any case", min=0.001)
    hang_stop_s: float = opt(60.0, "a step hung this long stops the instance (exit 4; its requests resume "
                             "elsewhere; 0 = never)", min=0.0)
    prefix_caching: bool = opt(True, "automatic prefix caching: a request starts at its longest cached prefix "
                               "(whole blocks); free blocks stay cached, evicted least-recently-used (vllm: "
                               "vLLM's own)")
    failpoints: str = opt("", "fault injection for tests, e.g. dest.drop_commit_reply (testing only)")
    vllm_args: str = opt("", "vllm engine: vLLM engine arguments as on vLLM's command line, e.g. "
                         "'--enforce-eager --gpu-memory-utilization 0.85' (also: after `--` on the command line)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cpus:
            try:
                parse_cpus(self.cpus)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def migration_config(self):
        from services.instance.migration import MigrationConfig

        return MigrationConfig(
            max_stages=self.migration_max_stages, last_stage_max_blocks=self.migration_last_stage_max_blocks,
            chunk_bytes=int(self.migration_chunk_mb * (1 << 20)), max_migrate_out=self.max_migrate_out,
            max_migrate_in=self.max_migrate_in, deadline_ms=self.migration_deadline_ms,
            max_migrate_out_per_dest=self.max_migrate_out_per_dest, copy_duty=self.migration_copy_duty,
            precopy_chunk_bytes=int(self.migration_precopy_chunk_mb * (1 << 20)), max_handoff_in=self.max_handoff_in,
            handoff_per_layer_threshold=self.handoff_per_layer_threshold, join_hold_ms=self.migration_join_hold_ms,
            join_notice=self.migration_join_notice, shared_kv=self.migration_shared_kv,
            fuse_last_stage=self.migration_fuse_last_stage)

    def queued_tokens_bound(self) -> int:
        if self.max_queued_tokens is not None:
            return self.max_queued_tokens
        return max(4 * self.max_num_batched_tokens, 8192)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            engine=self.engine, model=self.model, num_blocks=self.num_blocks, kv_cache_gb=self.kv_cache_gb,
            block_size=self.block_size or default_block_size(self.engine, self.device, self.dtype),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            device=self.device, dtype=self.dtype, token_delay_ms=self.token_delay_ms, profile=self.profile,
            seed=self.seed, share_kv=self.migration_shared_kv, prefix_caching=self.prefix_caching,
            extra=self._engine_extra(),
        )

    def _engine_extra(self) -> dict:
        extra: dict = {"num_threads": self.torch_threads} if self.torch_threads else {}
        if self.engine == "native":
            extra["kunserve_exchange_mb"] = self.kunserve_exchange_mb
            extra["kv_staging"] = self.migration_kv_staging
        if self.vllm_args:
            extra["vllm_args"] = self.vllm_args
        return extra


def default_block_size(engine: str, device: str = "cpu", dtype: str = "auto") -> int:
    if engine == "vllm":
        from services.instance.engine.vllm.args import default_block_size as vllm_default

        return vllm_default()
    if engine == "native":
        from services.instance.engine.native.engine import default_block_size as native_default

        return native_default(device, dtype)
    return 16


def event_to_pb(ev: Event, tokens: list[int], first_index: int, num_prompt_tokens: int = 0) -> pb.TokenEvent:
    """One TokenEvent for ``tokens`` (output positions from ``first_index``)
    and whatever else ``ev``, the last event they came with, says."""
    m = pb.TokenEvent(index=first_index if tokens else ev.index, token_ids=tokens,
                      finish_reason=ev.finish_reason or "", num_prompt_tokens=num_prompt_tokens)
    if ev.moved_to is not None:
        m.moved.instance_id, m.moved.address = ev.moved_to
        m.moved.next_index = ev.index
    if ev.error is not None:
        m.error_code, m.error_message = ev.error
    if ev.stats:
        m.num_preemptions = int(ev.stats.get("num_preemptions", 0))
        m.preemption_loss_ms = float(ev.stats.get("preemption_loss_ms", 0.0))
        m.num_migrations = int(ev.stats.get("num_migrations", 0))
    return m


class InstanceService(Service):
    name = "instance"
    service_names = ("ferry.v1.Instance",)

    def __init__(self, config: InstanceConfig):
        self.config = config
        if config.failpoints:  # first: the engine and its thread read theirs when they start
            failpoints.configure(config.failpoints)
        self.instance_id = config.instance_id or f"inst-{uuid.uuid4().hex[:8]}"
        self.engine = create_engine(config.engine_config())
        if Role.parse(config.role) is Role.PREFILL and self.engine.no_migration:
            raise ValueError(f"--role prefill needs live migration to hand requests over, and this "
                             f"{self.engine.name} engine cannot migrate: {self.engine.no_migration}")
        self.streams = StreamTable()
        self.headroom = high_priority_headroom(config.headroom_high, getattr(self.engine, "profile", None),
                                               self.engine.load().total_blocks)
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
        self.pipeline = None  # set in start(): services.instance.pipeline.PipelineHost (KunServe)
        self.migration_rpcs = None
        self.queue = QueueBound(config.queued_tokens_bound())
        self.registered = Registered(config.meta_store)
        self.hang: HangMonitor | None = None  # set in start()
        self.draining = False  # SIGTERM: handing the requests here over before stopping
        self.kv_events = KvEventPublisher(self.instance_id)

    # --- lifecycle --------------------------------------------------------------
    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_InstanceServicer_to_server(InstanceServicer(self), server)

    async def start(self, bound_address: str) -> None:
        host = self.config.advertise_host or self.config.host
        address = f"{host}:{bound_address.rsplit(':', 1)[1]}"
        e = self.engine
        self.info = InstanceInfo(self.instance_id, address, e.name, e.model_name, e.block_size,
                                 e.num_total_blocks, e.max_model_len, int(time.time() * 1000), e.vocab_size,
                                 no_migration=e.no_migration)
        self.runner = EngineRunner(self.engine, asyncio.get_running_loop(), self._on_step,
                                   on_kv_events=self.kv_events.publish)
        self.runner.start()
        from services.instance.migration import MigrationHost, MigrationManager
        from services.instance.migration.servicer import MigrationRpcs

        host = MigrationHost(self.instance_id, self.runner, self.streams, is_terminating=lambda: self.terminating,
                             load=lambda: self.load, headroom=self.headroom, changed=self._poke,
                             decodes=lambda: self.role.decodes)
        self.migration = MigrationManager(host, self.config.migration_config())
        self.migration_rpcs = MigrationRpcs(self.migration)
        from services.instance.pipeline import PipelineHost

        self.pipeline = PipelineHost(self.engine, self.runner)
        if self.config.metrics_port >= 0:
            from prometheus_client import start_http_server

            from services.instance import prefix_metrics

            prefix_metrics.export(lambda: self.load.prefix_cache, instance=self.instance_id)

            start_http_server(self.config.metrics_port, addr=self.config.host)
        self.reporter = StatusReporter(self.config.meta_store, self.info, self.status,
                                       self.config.report_interval_s, self.config.heartbeat_s)
        self.reporter.start()
        c = self.config
        self.hang = HangMonitor(self.runner, HangLimits(c.hang_factor, c.hang_floor_s, c.hang_stop_s),
                                self._on_health)
        self.hang.start()
        log.info("instance ready", instance_id=self.instance_id, address=address, engine=e.name,
                 blocks=e.num_total_blocks, block_size=e.block_size)

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
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            reason = out.finish_reason.value if out.finish_reason else None
            if out.error is not None:
                log.warning("request failed; the engine goes on", request_id=out.request_id, code=out.error[0],
                            error=out.error[1])
            stream.push(Event(out.index, out.token_id, reason, stats=out.stats, error=out.error))
            if reason and stream.attached:
                # NOTE: a migrated-in request that finishes before its client
                # re-attached keeps its stream until Attach drains it.
                self.streams.close(out.request_id)
            if self.migration is not None:
                self.migration.handoffs.on_output(out)  # after the stream has the token: `moved` comes next
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

    # --- status --------------------------------------------------------------
    def status(self) -> InstanceStatus:
        self.seq += 1
        m = self.migration
        return instance_status(self.instance_id, self.seq, time.time(), self.load, self.headroom,
                               self.terminating, m.migrating_in if m else 0, m.migrating_out if m else 0,
                               engine_steps=self.runner.steps if self.runner else 0, role=self.role,
                               unschedulable=self.hang is not None and self.hang.health is not Health.STEPPING)


class InstanceServicer(pb_grpc.InstanceServicer):
    def __init__(self, svc: InstanceService):
        self.svc = svc

    async def Generate(self, request, context):
        svc = self.svc
        if svc.dead:
            await abort_with(context, Unavailable(f"the engine of instance {svc.instance_id} is not running"))
        rid = request.request_id or uuid.uuid4().hex
        problem = request_id_problem(rid)
        if problem:
            await abort_with(context, InvalidArgument(problem, param="request_id"))
        if rid in svc.streams and not await svc.migration.dest.drop_unattached(rid):
            await abort_with(context, InvalidArgument(f"request id {rid!r} is already running here"))
        sampling = convert.sampling_from_pb(request.sampling)
        if not request.prompt_token_ids:
            await abort_with(context, InvalidArgument("prompt_token_ids is empty"))
        if sampling.max_tokens < 1:
            await abort_with(context, InvalidArgument("max_tokens must be >= 1"))
        if request.handoff.instance_id and not request.handoff.address:
            await abort_with(context, InvalidArgument("handoff names an instance without its address", param="handoff"))
        resume = tuple(request.resume_token_ids)
        if request.handoff.instance_id and request.handoff.instance_id != svc.instance_id:
            await svc.registered.check(request.handoff.instance_id, request.handoff.address, "handoff target")
        n_tokens = len(request.prompt_token_ids) + len(resume)
        refused = svc.queue.admit(svc.load, n_tokens, resumed=bool(resume))
        if refused:
            await abort_with(context, ResourceExhausted(refused))
        try:
            plan = self._plan_handoff(rid, request)
        except BaseException:
            svc.queue.dropped(n_tokens)
            raise
        ereq = EngineRequest(rid, tuple(request.prompt_token_ids), sampling, convert.priority_from_pb(request.priority),
                             time.time(), resume)
        stream = svc.streams.open(rid, next_index=len(resume))
        try:
            if not failpoints.enabled("instance.lose_requests"):  # tests: a request that never runs
                await svc.migration.handoffs.add(ereq, plan)  # a per-layer handoff starts with it
        except EngineBroken as e:
            svc.queue.dropped(n_tokens)
            svc.streams.close(rid)
            svc.migration.handoffs.forget(rid)
            await abort_with(context, Unavailable(str(e)))
        except EngineError as e:
            svc.queue.dropped(n_tokens)
            svc.streams.close(rid)
            svc.migration.handoffs.forget(rid)
            await abort_with(context, InvalidArgument(str(e)))
        except BaseException:
            svc.queue.dropped(n_tokens)
            raise
        svc.queue.added(n_tokens)
        async for m in self._follow(stream, rid, len(resume), len(request.prompt_token_ids),
                                    request.flush_interval_ms):
            yield m

    def _plan_handoff(self, rid: str, request):
        """Splitwise: the decode instance the scheduler chose for this request
        (None: it decodes here). Planned before the engine sees the request,
        so that its first token finds the plan."""
        target = request.handoff
        if not target.instance_id or target.instance_id == self.svc.instance_id:
            return None
        n = len(request.prompt_token_ids) + len(request.resume_token_ids)
        return self.svc.migration.handoffs.plan(rid, target.instance_id, target.address, n)

    async def Attach(self, request, context):
        stream = self.svc.streams.get(request.request_id)
        if stream is None or stream.attached:
            await abort_with(context, NotFound(f"request {request.request_id!r} is not here to attach to"))
        async for m in self._follow(stream, request.request_id, request.from_index, 0, request.flush_interval_ms):
            yield m

    async def _follow(self, stream, rid: str, from_index: int, num_prompt_tokens: int, flush_interval_ms: int):
        """The stream's events as TokenEvents. With a flush interval, tokens
        after the first are held and sent together at most that often; a
        final event (finished, or moved away) always goes at once with what
        is held."""
        stream.attached = True
        final = False
        interval_s = max(0, flush_interval_ms) / 1000.0
        held: list[int] = []
        held_from = 0
        last_sent: float | None = None
        try:
            async for ev in stream.events(from_index):
                final = ev.final
                if ev.error is not None and ev.finish_reason is None:
                    if held:  # what the client has not seen yet goes first
                        yield event_to_pb(Event(held_from), held, held_from)
                    raise FerryError(ev.error[1], code=Code(ev.error[0]))
                if ev.token_id is not None:
                    if not held:
                        held_from = ev.index
                    held.append(ev.token_id)
                now = time.monotonic()
                if final or last_sent is None or now - last_sent >= interval_s:
                    m = event_to_pb(ev, held, held_from, num_prompt_tokens)
                    held, last_sent = [], now
                    yield m
        finally:
            if self.svc.streams.get(rid) is stream:
                self.svc.streams.close(rid)
            if not final:  # the client went away: abort and free the blocks
                self.svc.migration.handoffs.forget(rid)
                self.svc.runner.submit(self.svc.engine.abort_request, rid)
                log.info("client gone; request aborted", request_id=rid)

    async def Abort(self, request, context):
        self.svc.migration.handoffs.forget(request.request_id)
        found = await self.svc.runner.call(self.svc.engine.abort_request, request.request_id)
        self.svc._end_stream(request.request_id, "abort")
        return pb.AbortReply(found=bool(found))

    async def GetStatus(self, request, context):
        return convert.status_to_pb(self.svc.status())

    async def SetTerminating(self, request, context):
        self.svc.terminating = request.terminating
        log.info("terminating mark", terminating=request.terminating)
        if self.svc.reporter:
            self.svc.reporter.poke()
        return pb.SetInstanceTerminatingReply(ok=True)

    async def SetRole(self, request, context):
        """Splitwise: what this instance runs from now on. Becoming prefill
        drains the requests decoding here to ``drain_to`` by live migration."""
        from services.instance.migration.drain import decoding_here

        svc = self.svc
        role = convert.role_from_pb(request.role)
        targets = [(h.instance_id, h.address) for h in request.drain_to
                   if h.instance_id and h.instance_id != svc.instance_id]
        if any(h.instance_id and not h.address for h in request.drain_to):
            raise InvalidArgument("drain_to names an instance without its address", param="drain_to")
        for iid, address in targets:
            await svc.registered.check(iid, address, "drain_to instance")
        draining = 0
        if role is Role.PREFILL:
            if svc.engine.no_migration:
                raise FailedPrecondition(f"this instance cannot hand requests over: {svc.engine.no_migration}")
            ready, waiting = decoding_here(svc.migration)
            if (ready or waiting) and not targets:
                raise FailedPrecondition(f"{len(ready) + waiting} requests would decode here and no drain_to "
                                         "instance was given")
            draining = len(ready)
        previous, svc.role = svc.role, role
        log.info("role changed", role=role.value, previous=previous.value, draining=draining)
        svc._poke()
        if role is Role.PREFILL and targets:
            svc.migration.start_drain(targets, still=lambda: svc.role is Role.PREFILL)
        return pb.SetRoleReply(previous=convert.role_to_pb(previous), draining=draining)

    async def CheckIntegrity(self, request, context):
        svc = self.svc

        def check():
            err = ""
            try:
                svc.engine.check_integrity()
            except AssertionError as e:
                err = str(e) or "integrity check failed"
            hashes = svc.engine.cached_hashes() if request.with_cached_hashes else []
            return err, svc.engine.num_free_blocks, svc.engine.load(), hashes

        err, free, load, hashes = await svc.runner.call(check)
        reservations = len(svc.migration.reservations) if svc.migration else 0
        return pb.CheckIntegrityReply(ok=not err, error=err, free_blocks=free,
                                      total_blocks=svc.engine.num_total_blocks,
                                      num_requests=len(load.requests), num_reservations=reservations,
                                      cached_block_hashes=hashes)

    async def WatchKvEvents(self, request, context):
        """The prefix cache's events: a snapshot, then each step's batch."""
        q = self.svc.kv_events.subscribe()
        try:
            while (item := await q.get()) is not None:
                if isinstance(item, KvSnapshot):
                    yield pb.KvEventsMessage(snapshot=convert.kv_snapshot_to_pb(item))
                else:
                    yield pb.KvEventsMessage(batch=convert.kv_batch_to_pb(item))
        finally:
            self.svc.kv_events.unsubscribe(q)

    # Migration RPCs: protobuf <-> domain types in services/instance/migration/servicer.py.
    async def MigrateOut(self, request, context):
        rpcs = self._migration()
        await self.svc.registered.check(request.dest_instance_id, request.dest_address)
        return await rpcs.migrate_out(request)

    async def PreAllocate(self, request, context):
        return await self._migration().pre_allocate(request)

    async def TransferKv(self, request_iterator, context):
        return await self._migration().transfer_kv(request_iterator)

    async def Commit(self, request, context):
        return await self._migration().commit(request)

    async def AbortMigration(self, request, context):
        return await self._migration().abort(request)

    async def ExpectCommit(self, request, context):
        return await self._migration().expect_commit(request)

    async def MigrationSettled(self, request, context):
        return await self._migration().settled(request)

    # KunServe's pipeline: services/instance/pipeline.py.
    async def DropLayers(self, request, context):
        return await self._pipeline().drop_layers(request)

    async def SetPipeline(self, request, context):
        return await self._pipeline().set_pipeline(request)

    async def RestoreLayers(self, request, context):
        return await self._pipeline().restore_layers(request)

    async def FetchLayers(self, request, context):
        async for t in self._pipeline().fetch_layers(request):
            yield t

    async def ForwardLayers(self, request_iterator, context):
        async for reply in self._pipeline().serve(request_iterator):
            yield reply

    def _pipeline(self):
        if self.svc.pipeline is None:
            raise FailedPrecondition("this instance is not serving yet")
        return self.svc.pipeline

    def _migration(self):
        if self.svc.migration is None:
            raise FailedPrecondition("migration is not available on this instance")
        return self.svc.migration_rpcs


__all__ = ["InstanceService", "InstanceConfig", "ENGINES"]
