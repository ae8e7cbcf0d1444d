"""One simulated run: a workload (ferry/measure/workload.py, the same specs and
seeds as ``ferry bench compare``) replayed against N simulated instances
under one dispatch policy; returns the run dict ``ferry bench serving``
returns (options, workload, summary, samples, per-request records).

Configuration comes from the live services' own configs: ``--instance-arg``
and ``--scheduler-arg`` are parsed by InstanceConfig and SchedulerConfig, so
a flag means the same here as on a live cluster. Under ``--sim-slowdown K``
the live benchmark runs the profile K times slower while control-plane
intervals and delays stay wall time; the simulator runs the profile as is and
divides every wall-time figure by K, which is the same model time.

``pools`` (Splitwise, ferry/sim/pools.py) makes a cluster of prefill, decode
and mixed instances, each pool on its own profile; requests prefilled on a
prefill instance are handed to the decode instance Dispatch chose with it,
by the live handoff code (ferry/sim/handoff.py records them).
``fake_tokens`` runs the live sim engine's fake model (slower) so that the
tokens of every request can be checked; the run then also returns them.

Prompts are token ids as the live client sends them (ferry/measure/prefixes.py:
shared system prompts, multi-turn sessions whose later turns carry the
answers so far, Mooncake-format traces), so that the engines' prefix caches
hit as live ones do; the run's ``summary.prefix_cache`` holds the hit rates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click
import structlog

from ferry.measure import hit_rate, metrics, prefixes, programs
from ferry.measure import workload as wl
from ferry.bench.serving import slowed_intervals
from ferry.sim.aio import DelayedPeer, SimLoop
from ferry.sim.control import SimClients, SimLauncher
from ferry.sim.handoff import HandoffLog
from ferry.sim.instance import SimInstance
from ferry.sim.kernel import START, Kernel
from ferry.sim.migration import MigrationModel
from ferry.sim.params import Delays, TransferModel
from ferry.sim.pools import Pool, parse_pools
from ferry.sim.recorder import Recorder
from ferry.sim.scheduler import SimScheduler
from libs.common.config import click_options, from_options
from libs.common.logging import setup_logging
from libs.common.policies import get as get_policy
from libs.common.policies.phases import DEFAULT_PER_LAYER_THRESHOLD, needs_handoff
from libs.common.errors import InvalidArgument
from libs.common.types import GenerateOrder, Priority, Role, SamplingParams, TokenOutput
from services.instance.engine.sim import SimProfile
from services.instance.engine.fake import VOCAB_HI, VOCAB_LO
from services.instance.config import InstanceConfig
from services.instance.migration.peer import InProcessPeer
from services.instance.status import high_priority_headroom
from services.scheduler.autoscaler import (
    DRAIN_TIMEOUT_S,
    REGISTER_TIMEOUT_S,
    STARTUP_GRACE_S,
    AutoscalePolicy,
    Autoscaler,
)
from services.scheduler.service import SchedulerConfig

EXPIRE_S = 0.05  # the live migration managers' expiry interval (MigrationManager's default)


def _no_fault(point: str) -> None:
    """No fault points in a simulated run (the live default exits the process on some)."""


WARMUP_S = 1.0  # the cluster is up and has reported before the first request


@dataclass(frozen=True)
class SimOptions(prefixes.WorkloadOptions):  # max_model_len None: the profile's
    instances: int = 2
    profile: str = "llama-7b-a10"
    sim_slowdown: float = 1.0
    instance_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    delays: Delays = field(default_factory=Delays)
    kv_bytes_per_token: int | None = None  # None: the profile's
    migration_bandwidth_gbps: float | None = None
    sample_interval_s: float = 0.5
    progress: bool = True
    pools: tuple[str, ...] = ()  # ROLE:PROFILE:COUNT; empty: `instances` mixed instances of `profile`
    per_layer_threshold: int = DEFAULT_PER_LAYER_THRESHOLD  # handoff_mode's (0: always serialized)
    fake_tokens: bool = False
    report_clip: bool = True  # say on stderr how many requests were clipped to the context
    # The programs' floor: their metrics had every turn been served by one cache of the cluster's every KV
    # block with the optimal eviction (hit_rate.capacity_bound), in summary["programs_floor"].
    capacity_bound: bool = False


def parse_config(cls: type, args: list[str]):
    """A live service config from its command-line flags (and FERRY_* env)."""
    @click.command()
    @click_options(cls)
    def cmd(**kw):
        return from_options(cls, kw)

    return cmd.main(list(args), standalone_mode=False)


def configs(opts: SimOptions, policy: str) -> tuple[InstanceConfig, SchedulerConfig]:
    """The configs a live benchmark would start its services with (wall time)."""
    inst_slow, sched_slow = slowed_intervals(opts.sim_slowdown)
    pol = get_policy(policy)  # Continuum's pinning and keep are the engines' (before --instance-arg, which wins)
    pin = ["--program-ttl-s", f"{pol.program_ttl_s / opts.sim_slowdown!r}"] if pol.program_ttl_s > 0 else []
    if pol.program_keep > 0:
        gap = InstanceConfig.program_gap_s  # the default, in model seconds
        pin += ["--program-keep", f"{pol.program_keep!r}", "--program-gap-s", f"{gap / opts.sim_slowdown!r}"]
    # No queue bound at the instances: a refused request's retry elsewhere is the frontend's, not simulated.
    icfg = parse_config(InstanceConfig, ["--engine", "sim", "--profile", opts.profile, *inst_slow, *pin,
                                         "--max-queued-tokens", "0", *opts.instance_args])
    if icfg.max_queued_tokens:
        raise click.UsageError("--max-queued-tokens: the simulator does not model the frontend's retry of a "
                               "request an instance's full queue refused; leave it at 0")
    scfg = parse_config(SchedulerConfig, ["--dispatch", policy, *sched_slow, *opts.scheduler_args])
    return icfg, scfg


def profile_of(opts: SimOptions, name: str | None = None) -> SimProfile:
    p = SimProfile.load(name or opts.profile)
    over = {k: v for k, v in (("kv_bytes_per_token", opts.kv_bytes_per_token),
                              ("migration_bandwidth_gbps", opts.migration_bandwidth_gbps)) if v is not None}
    return dataclasses.replace(p, **over) if over else p


def pools_of(opts: SimOptions) -> tuple[Pool, ...]:
    return parse_pools(opts.pools) if opts.pools else (Pool(Role.MIXED, opts.profile, opts.instances),)


def max_model_len_of(opts: SimOptions) -> int:
    """What every instance of the cluster admits."""
    return opts.max_model_len or min(profile_of(opts, p.profile).max_model_len for p in pools_of(opts))


class Cluster:
    """Instances, scheduler, frontend and recorder wired on one kernel."""

    def __init__(self, opts: SimOptions, policy: str, work: wl.Workload):
        self.opts = opts
        if not structlog.is_configured():  # the live migration code logs every transition at info
            setup_logging("warning")
        icfg, scfg = configs(opts, policy)
        k = self.k = Kernel()
        wall = 1.0 / opts.sim_slowdown  # wall-time figures -> model time
        self.delays = opts.delays.scaled(wall)
        self.profile = profile_of(opts)
        self.engine_config = icfg.engine_config()
        self.icfg, self.scfg = icfg, scfg
        self.wall = wall
        self.pools = pools_of(opts)
        self.profiles = {p.profile: profile_of(opts, p.profile) for p in self.pools}
        self.profile = self.profiles[self.pools[0].profile]  # the autoscaler's, and migration's link
        transfer = TransferModel.from_profile(self.profile)  # wall time on a live cluster too
        transfer = transfer.with_(bandwidth_bytes_per_s=transfer.bandwidth_bytes_per_s / wall,
                                  stage_overhead_s=transfer.stage_overhead_s * wall)
        self.migration = MigrationModel(dataclasses.replace(
            icfg.migration_config(), handoff_per_layer_threshold=opts.per_layer_threshold), self.delays, transfer)
        # The live migration (MigrationManager, SourceMigration, Destination) and Splitwise handoffs
        # (Handoffs, LayerwiseHandoff) run on this loop, one manager per instance.
        self.loop = SimLoop(k)
        k.loop = self.loop
        self.instances: dict[str, SimInstance] = {}
        self.t0 = START + WARMUP_S
        self.recorder = Recorder(work, self.t0, self.delays.token_s, wall)
        self.scheduler = SimScheduler(k, scfg, self.migration, self.instances, scfg.migrate_interval_s * wall,
                                      self.loop, clients=SimClients(self))
        self.handoff = HandoffLog(self, self.transfer_s, opts.per_layer_threshold)
        self.prompt_lens: dict[str, int] = {}  # request id -> its prompt's tokens (a session's turn: all of it)
        self.autoscaler = self._autoscaler(scfg, wall) if scfg.autoscale else None
        self.work = work
        self.tokens: dict[str, list[int]] | None = {} if opts.fake_tokens else None
        # Requests that arrive by the clock (a session's later turns follow its previous answer)
        self.first_turns = [i for i, r in enumerate(work.requests) if r.session < 0 or r.turn == 0]
        self.next_turn: dict[int, int] = {}
        self.prev_turn: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, r in enumerate(work.requests):
            if r.session >= 0:
                if r.session in last:
                    self.next_turn[last[r.session]] = i
                    self.prev_turn[i] = last[r.session]
                last[r.session] = i
        # The prompts and answers (prefix workloads: the hit-rate bound; sessions' next turns)
        self.keep_tokens = work.prefix != "none"
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.answers: dict[int, list[int]] = {}
        self.samples: list[dict] = []
        self.instance_log: list[tuple[float, int]] = []  # (t, live instances) after each change
        for pool in self.pools:
            for _ in range(pool.count):
                self.add_instance(self.profiles[pool.profile], pool.role)
        self.scheduler.start()
        if self.autoscaler:
            with self.loop.running():
                self.autoscaler.start()
        if self.first_turns:
            k.at(self.t0 + work.requests[self.first_turns[0]].arrival_s * wall, self._arrive, 0)
        k.at(self.t0, self._sample)

    def _autoscaler(self, c: SchedulerConfig, wall: float) -> Autoscaler:
        """services/scheduler/autoscaler.py's Autoscaler itself on this loop,
        its launcher and clients the simulator's (control.py); windows,
        cooldowns and intervals are wall time on a live cluster."""
        policy = AutoscalePolicy(c.scale_out_below, c.scale_in_above, c.scale_window_s * wall, c.min_instances,
                                 c.max_instances, c.scale_cooldown_s * wall, max_launch=c.scale_out_max_launch)
        clock = self.loop.time
        return Autoscaler(self.scheduler, SimLauncher(self), policy, interval_s=c.autoscale_interval_s * wall,
                          drain_timeout_s=DRAIN_TIMEOUT_S * wall, startup_grace_s=STARTUP_GRACE_S * wall,
                          register_timeout_s=REGISTER_TIMEOUT_S * wall, clients=SimClients(self), clock=clock,
                          wall_clock=clock)

    def scale_events(self) -> list[dict]:
        """The autoscaler's actions, at their times since the first arrival."""
        return [{"t": ev.t - self.t0, "action": ev.action, "instance": ev.instance_id, "reason": ev.reason,
                 "done_at": None if ev.done_at is None else ev.done_at - self.t0} for ev in self.autoscaler.events]

    # --- instances -----------------------------------------------------------------------
    def add_instance(self, profile: SimProfile | None = None, role: Role = Role.MIXED) -> SimInstance:
        iid = f"inst-{len(self.instances):03d}"
        profile = profile or self.profile
        inst = SimInstance(self.k, iid, profile, self.engine_config,
                           high_priority_headroom(self.icfg.headroom_high, profile, self.engine_config.num_blocks),
                           self.icfg.report_interval_s * self.wall, self.icfg.heartbeat_s * self.wall,
                           self.delays.hop_s, self._on_step, self._on_report, role=role,
                           fake_tokens=self.opts.fake_tokens, config=self.icfg)
        inst.serve(self.loop, self.migration.config, lambda address, src=inst: self._peer(src, address),
                   fault=_no_fault, expire_interval_s=EXPIRE_S)
        if needs_handoff(role):
            self.handoff.watch(inst)
        self.instances[iid] = inst
        self._log_instances()
        return inst

    def transfer(self, src: SimInstance, dst: SimInstance) -> TransferModel:
        """The KV link between two instances: the source's block bytes, the
        slower one's bandwidth (the cluster's profile: ``migration.transfer``)."""
        if src.profile is dst.profile is self.profile:
            return self.migration.transfer
        gbps = min(src.profile.migration_bandwidth_gbps, dst.profile.migration_bandwidth_gbps)
        return self.migration.transfer.with_(bytes_per_block=src.profile.kv_bytes_per_token * src.profile.block_size,
                                             bandwidth_bytes_per_s=gbps * 1e9 / 8 / self.wall)

    def transfer_s(self, src: SimInstance, dst: SimInstance, blocks: int) -> float:
        return self.transfer(src, dst).seconds(blocks)

    def _peer(self, src: SimInstance, address: str) -> DelayedPeer:
        """The live migration's peer from ``src`` to a destination: its
        Destination in this process, the round trips and blocks charged
        (Delays.rpc_s, TransferModel.seconds; a per-layer chunk as its share
        of a block of the source's KV layout)."""
        dst = self.instances[address]
        link = self.transfer(src, dst)
        layout_block = src.engine.kv_layout.bytes_per_block
        return DelayedPeer(InProcessPeer(dst.manager.dest), self.delays.rpc_s, link.seconds,
                           lambda n: n / layout_block * link.bytes_per_block / link.bandwidth_bytes_per_s)

    def close(self) -> None:
        """End the live migration managers' tasks (their expiry loops) on the loop."""
        with self.loop.running():
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
        self.k.run(until=self.k.now)

    def stop_instance(self, iid: str) -> None:
        self.instances[iid].stop()
        self.scheduler.remove(iid)
        self._log_instances()

    def live_instances(self) -> list[SimInstance]:
        return [i for i in self.instances.values() if not i.stopped]

    def _log_instances(self) -> None:
        launching = len(self.autoscaler.launching) if self.autoscaler else 0
        self.instance_log.append((self.k.now, len(self.live_instances()) + launching))

    def _on_step(self, inst: SimInstance, outputs: list[TokenOutput]) -> None:
        self.recorder.on_tokens(self.k.now, outputs)
        for o in outputs:  # the prompt's tokens served from cache, where its first token came from
            if o.index == 0:
                rec = self.recorder.records[self.recorder.index[o.request_id]]
                if rec.cached_tokens is None:
                    st = o.stats if o.finish_reason is not None and o.stats else \
                        inst.engine.request_stats(o.request_id)
                    rec.cached_tokens = int(st.get("prefix_hit_tokens", 0))
        if self.keep_tokens:
            for o in outputs:
                i = self.recorder.index[o.request_id]
                if o.token_id is not None:
                    self.answers.setdefault(i, []).append(o.token_id)
                if o.finish_reason is not None and i in self.next_turn:
                    nxt = self.next_turn[i]
                    # the client gets the last token, the user thinks, the next turn is sent
                    self.k.after(self.delays.token_s + self.work.requests[nxt].think_s * self.wall,
                                 self._send, nxt)
        if self.tokens is not None:
            for o in outputs:
                toks = self.tokens.setdefault(o.request_id, [])
                if o.index != len(toks):
                    raise RuntimeError(f"{o.request_id}: token index {o.index} after {len(toks)} tokens")
                toks.append(o.token_id)
        if needs_handoff(inst.role):
            for o in outputs:
                if o.index == 0:
                    self.handoff.on_first_token(o.request_id, self.k.now)

    def _on_report(self, inst: SimInstance, status) -> None:
        self.k.after(self.delays.report_s, self.scheduler.deliver, status)

    # --- the frontend ----------------------------------------------------------------------
    def _arrive(self, pos: int) -> None:
        self._send(self.first_turns[pos])
        if pos + 1 < len(self.first_turns):  # one arrival in the queue at a time
            nxt = self.first_turns[pos + 1]
            self.k.at(self.t0 + self.work.requests[nxt].arrival_s * self.wall, self._arrive, pos + 1)

    def _send(self, i: int) -> None:
        rec = self.recorder.records[i]
        rec.sent_at = self.k.now
        if self.work.requests[i].turn > 0:
            rec.scheduled_at = self.k.now
        self.k.after(self.delays.dispatch_s, self._dispatch, i)

    def prompt(self, i: int) -> tuple[int, ...]:
        """Request i's prompt ids: a session turn's after the conversation so far."""
        req = self.work.requests[i]
        own = wl.prompt_ids(req, self.opts.seed, VOCAB_LO, VOCAB_HI)
        if req.session >= 0 and req.turn > 0:
            prev = self.prev_turn[i]
            own = list(self.prompts[prev]) + self.answers.get(prev, []) + own
        return tuple(own)

    def _dispatch(self, i: int) -> None:
        req = self.work.requests[i]
        # Prefix-aware policies get the prompt's block hashes, as the live frontend sends them.
        prompt = self.prompt(i) if self.scheduler.policy.uses_prefix else None
        picked = self.scheduler.dispatch(f"req-{i}", req.prompt_len, Priority.parse(req.priority), prompt,
                                         wl.program_id(req))
        if picked is None:
            self.recorder.fail(i, self.k.now, "no live instance to dispatch to")
            return
        placed, run_priority = picked
        self.recorder.records[i].instances.append(placed.prefill)
        self.k.after(self.delays.generate_s, self._generate, i, placed.prefill, run_priority, placed.decode)

    def _generate(self, i: int, iid: str, priority: Priority, decode: str | None = None) -> None:
        """The frontend's Generate at the chosen instance: the agent's own
        (``Agent.admit``: the checks, the engine, a Splitwise handoff's plan);
        the simulated client follows the request by the step delivery (``_on_step``)."""
        req = self.work.requests[i]
        inst = self.instances[iid]
        sp = SamplingParams(max_tokens=req.output_len, min_tokens=req.output_len, ignore_eos=True)
        prompt = self.prompt(i)
        if self.keep_tokens:
            self.prompts[i] = prompt
        rid = f"req-{i}"
        self.prompt_lens[rid] = len(prompt)
        if decode is None and needs_handoff(inst.role):
            self.handoff.in_place(inst, rid, len(prompt))
        order = GenerateOrder(rid, prompt, sp, priority, handoff=None if decode is None else (decode, decode),
                              program_id=wl.program_id(req))
        self.loop.create_task(self._admit(i, inst, order))

    async def _admit(self, i: int, inst: SimInstance, order: GenerateOrder) -> None:
        try:
            await inst.agent.admit(order)
        except InvalidArgument as e:
            self.recorder.fail(i, self.k.now, f"HTTP 400: {e}")

    # --- cluster samples (serving.sample_cluster) --------------------------------------------
    def _sample(self) -> None:
        caches = [i.engine.pool.cache.stats for i in self.instances.values()]
        self.samples.append({"t": self.k.now - self.t0, "migrations_ordered": self.scheduler.migrations_ordered,
                             # cumulative, over the cluster: prompt blocks looked up / served from cache
                             "prefix_queries": sum(c.queries for c in caches),
                             "prefix_hits": sum(c.hits for c in caches),
                             "migration_blocks_sent": self.scheduler.blocks_sent,
                             "migration_blocks_linked": self.scheduler.blocks_linked,
                             "instances": {iid: {"freeness": s.freeness, "num_running": s.num_running,
                                                 "num_waiting": s.num_waiting, "free_blocks": s.free_blocks,
                                                 "num_preemptions": s.num_preemptions,
                                                 "migrating_out": s.migrating_out}
                                           for iid, s in self.scheduler.statuses.items()}})
        if self.recorder.done < len(self.work.requests):
            self.k.after(self.opts.sample_interval_s, self._sample)

    # --- running ---------------------------------------------------------------------------
    def run(self, on_progress: Callable[[int, float], None] | None = None, chunk_s: float = 5.0,
            stall_s: float = 120.0) -> None:
        n = len(self.work.requests)
        last, moved_at = None, self.k.now
        while self.recorder.done < n:
            self.k.run(until=self.k.now + chunk_s)
            if on_progress:
                on_progress(self.recorder.done, self.k.now - self.t0)
            now_state = (self.recorder.done, sum(i.steps for i in self.instances.values()))
            if now_state != last:
                last, moved_at = now_state, self.k.now
            elif self.k.now - moved_at > stall_s and self.k.now > self.t0 + self.work.duration_s * self.wall:
                # E.g. a request longer than the KV cache: it preempts itself
                # forever, as it would on a live instance.
                raise RuntimeError(f"simulation stalled: {n - self.recorder.done} requests unfinished and no "
                                   f"engine step for {stall_s:g} s of model time")
        self.end = max(r.finished_at for r in self.recorder.records)

    def settle(self, horizon_s: float = 2.0) -> dict:
        """Let what is still under way after the last finish end (handoffs'
        drops at their source, aborts), then check every engine: no request
        left, no block used or reserved, the pool's integrity. Returns the
        counts (all zero on a sound run)."""
        self.k.run(until=self.k.now + horizon_s)
        left = {"requests": 0, "used_blocks": 0, "reserved_blocks": 0, "handoffs_under_way": self.handoff.active}
        for inst in self.instances.values():
            eng = inst.engine
            eng.check_integrity()
            left["requests"] += len(eng.requests)
            left["used_blocks"] += eng.pool.num_used
            left["reserved_blocks"] += eng.pool.num_reserved
        return left

    def prefix_summary(self) -> dict:
        """The engines' prefix-cache stats and, for a prefix workload, the bound."""
        stats = {iid: i.engine.prefix_cache_stats() for iid, i in self.instances.items()}
        reqs = None
        if self.keep_tokens:
            order = sorted(self.prompts, key=lambda i: (self.recorder.records[i].sent_at or 0.0, i))
            reqs = [(list(self.prompts[i]), self.answers.get(i, [])) for i in order]
        return hit_rate.summary(stats, reqs, self.profile.block_size)

    def programs_floor(self) -> dict:
        """The programs' summary (ferry/measure/programs.py) with each turn's
        cached tokens those of hit_rate.capacity_bound over the cluster's
        every KV block in one cache: what returning turns recompute at least,
        whatever the placement and the eviction. The prompts are this run's
        (the same for every policy: the sim model's answers are a function
        of the prompt)."""
        order = sorted(self.prompts, key=lambda i: (self.recorder.records[i].sent_at or 0.0, i))
        capacity = sum(i.engine.pool.capacity for i in self.instances.values())
        bs = self.profile.block_size
        hits = hit_rate.capacity_bound([(list(self.prompts[i]), self.answers.get(i, [])) for i in order], bs,
                                       capacity)
        cached = dict(zip(order, hits))
        records = [dataclasses.replace(r, cached_tokens=cached.get(i, 0) * bs)
                   for i, r in enumerate(self.recorder.records)]
        out = programs.summary(self.work.requests, records, bs)
        return {"capacity_blocks": capacity, **{k: out[k] for k in (
            "returning_prompt_tokens", "returning_computed_tokens", "returning_computed_fraction", "prefix_tokens",
            "prefix_recomputed_tokens", "prefix_recomputed_fraction")}}

    def instance_table(self) -> dict:
        return {iid: {"role": i.role.value, "profile": i.profile.name, "prefill_tokens": i.executor.prefill_tokens,
                      "decode_tokens": i.executor.decode_tokens, "busy_s": i.executor.busy_s, "steps": i.steps}
                for iid, i in self.instances.items()}

    def instance_seconds(self) -> float:
        """Live instances integrated from the first request to the last finish."""
        total, prev_t, prev_n = 0.0, self.t0, None
        for t, n in self.instance_log:
            if prev_n is not None:
                total += prev_n * max(0.0, min(t, self.end) - max(prev_t, self.t0))
            prev_t, prev_n = max(t, prev_t), n
        total += prev_n * max(0.0, self.end - max(prev_t, self.t0))
        return total


def simulate(opts: SimOptions, policy: str, label: str | None = None,
             extend: Callable[[Cluster], Any] | None = None) -> dict:
    """One run. The result holds no wall-clock figure: the same options give
    the same dict (wall time is returned under ``_wall_s``, kept out of JSON).
    ``extend(cluster)``: wires more onto the cluster before it runs (KunServe)
    and returns an object whose ``summary()`` goes into ``sim["extension"]``."""
    label = label or policy
    work = opts.workload(opts.sim_slowdown, max_model_len_of(opts))
    if work.clip and work.clip.clipped and opts.report_clip:
        click.echo(f"[{label}] {work.clip.line()}", err=True)
    t_wall = time.perf_counter()
    cluster = Cluster(opts, policy, work)
    extension = extend(cluster) if extend else None
    bar = None
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(work.requests), desc=f"{label} seed {opts.seed}", unit="req", dynamic_ncols=True,
                   mininterval=1.0, file=sys.stderr)

    def progress(done: int, sim_s: float) -> None:
        bar.n = done
        bar.set_postfix_str(f"{sim_s:.0f} sim-s, {sim_s / max(1e-9, time.perf_counter() - t_wall):.3g} sim-s/s",
                            refresh=False)
        bar.refresh()

    try:
        cluster.run(progress if bar else None)
    finally:
        if bar:
            bar.close()
    wall = time.perf_counter() - t_wall
    summary = metrics.summarize(cluster.recorder.records)
    summary["dead_processes"] = []
    summary["migrations_ordered"] = cluster.scheduler.migrations_ordered
    summary["prefix_cache"] = cluster.prefix_summary()
    prog = programs.summary(work.requests, cluster.recorder.records, cluster.profile.block_size)
    if prog is not None:  # a workload of programs' turns (agentic, sessions)
        summary["programs"] = prog
        if opts.capacity_bound:
            summary["programs_floor"] = cluster.programs_floor()
    # Blocks sent by committed migrations, and those the destinations linked
    # instead (a prefix-blind migration of the same requests sends both).
    summary["migration_blocks"] = {"sent": cluster.scheduler.blocks_sent, "linked": cluster.scheduler.blocks_linked}
    if cluster.scheduler.policy.moves_kept:
        summary["cache_moves"] = cluster.scheduler.cache_move_summary(cluster.migration.transfer.bytes_per_block)
    sim_s = cluster.end - cluster.t0
    outcomes = cluster.scheduler.outcomes
    committed = [o for o in outcomes if o.committed]
    sim = {"model_s": sim_s, "steps": sum(i.steps for i in cluster.instances.values()),
           "events": cluster.k.events, "reports": sum(i.reports for i in cluster.instances.values()),
           "late_reports": sum(i.late_reports for i in cluster.instances.values()),
           "migrations_committed": len(committed), "migrations_aborted": len(outcomes) - len(committed),
           "migration_downtime_ms_mean": (sum(o.downtime_ms for o in committed) / len(committed)
                                          if committed else None),
           # summary["migration_blocks"] again, where the plots read it
           "migration_blocks_sent": summary["migration_blocks"]["sent"],
           "migration_blocks_linked": summary["migration_blocks"]["linked"],
           "instance_seconds": cluster.instance_seconds(),
           "delays_model_s": dataclasses.asdict(cluster.delays),
           "transfer": dataclasses.asdict(cluster.migration.transfer)}
    if cluster.autoscaler:
        sim["scale_events"] = cluster.scale_events()
    if extension is not None:
        sim["extension"] = extension.summary()
    if opts.pools:
        sim["pools"] = [p.spec for p in cluster.pools]
        sim["handoff"] = cluster.handoff.summary()
        sim["instances"] = cluster.instance_table()
        sim["left_at_end"] = cluster.settle()
    cluster.close()
    out = {"label": label, "dispatch": policy, "options": _jsonable(opts), "time_scale": 1.0,
            "workload": work.describe(), "summary": summary, "sim": sim, "samples": cluster.samples,
            "requests": [r.to_dict() for r in cluster.recorder.records], "_wall_s": wall}
    if opts.pools:
        out["handoffs"] = cluster.handoff.record_dicts()
    if cluster.tokens is not None:
        out["tokens"] = cluster.tokens
    return out


def _jsonable(opts: SimOptions) -> dict:
    d = dataclasses.asdict(opts)
    d.pop("progress")
    d.pop("report_clip")
    if not opts.pools:  # a cluster of mixed instances: the options read as before pools existed
        for k in ("pools", "per_layer_threshold"):
            d.pop(k)
    if not opts.fake_tokens:
        d.pop("fake_tokens")
    return d
