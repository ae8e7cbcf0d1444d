"""KunServe on the simulated cluster (issue 20; paper 002, §4): under memory
throttling, instances drop parameter layers into buddy groups that serve as
a pipeline, and restore them when the pressure ends.

What runs is Ferry's own code: the throttle forecast and the buddy-group
planner (``libs/common/policies/kunserve.py``), the engine core's block pool
growing and shrinking (``BlockPool.grow`` / ``shrink``), and the whole
simulated cluster of ``ferry/sim/run.py`` (dispatch, engines, reports).

The controller (``KunServe``) wakes every ``interval_s`` of model time, as a
monitor beside the scheduler would, and reads what the scheduler reads: the
delivered status reports.

- **Drop** (§4.1, §4.3): with the samples of the last ``window_s``, when
  ``predict_throttle`` finds an instance that is not in a group throttled
  within ``horizon_s``, ``plan_buddy_groups`` picks groups for the summed
  deficit. Each member frees the parameter memory of the layers it drops:
  its KV pool grows by that many blocks at its next step boundary.
- **KV exchange with remote attention** (§4.2): each member's running
  requests keep decoding while (k-1)/k of their KV moves to the members now
  holding those layers. It takes that many bytes over the profile's link
  (the largest member's share); meanwhile steps run ``1 +
  remote_attention_overhead`` times slower.
- **Pipelined execution** (§4.2): each member keeps scheduling its own
  requests; their micro-batches pass through all k stages. Ideally a group
  of k serves the union of its members' batches with the same compute
  (each stage does 1/k of every micro-batch), so a member's step takes what
  its own batch takes, plus k-1 activation hops; what a real pipeline loses
  (bubbles, smaller kernels per stage, communication) is
  ``pipeline_overhead``: every step takes ``1 + pipeline_overhead`` times
  longer. Its default, 0.2, is the throughput the paper measured a static
  pipeline to lose against replication, 12.6-21.8% (§5.1): 1/(1 - 0.17).
- **Restore** (§4.2, "live KVCache restore"): once every member's
  requirement (used + queued blocks) fits ``1 - restore_margin`` of its own
  memory and its forecast against that memory is not throttled (and the
  group is at least ``min_group_s`` old), each member's pool shrinks back
  (blocks in use are retired as they are freed), then the dropped parameters
  and the remote share of the KV come back over the link; the group then
  dissolves.
- **Static pipeline** (the paper's "Llumnix (pipeline)" baseline,
  ``static_group_size``): groups of that size formed before the first
  request and never restored.

Simplifications, each on the side of the pipeline's cost:
- A member's requests are charged to its own pool: the group's memory is not
  pooled across members (in KunServe each request's KV is spread over the
  stages). The dispatcher balances new requests over members by freeness.
- The pool shrinks by a count of blocks, whichever ids come free: in a real
  engine, the live restore moves KV off the memory the parameters return
  to; its transfer is charged to the restore time.
- A group throttled again merges with the group that has the most free
  memory (one replica's parameters more), as Algorithm 1 goes on merging;
  one merge per monitor tick. Each merge is charged a KV exchange as if it
  were a fresh drop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from ferry.sim.instance import SimInstance
from libs.common.policies.kunserve import (
    BuddyGroup,
    Candidate,
    MemorySample,
    add_sample,
    buddy_group,
    fits_own_memory,
    plan_buddy_groups,
    predict_throttle,
)
from libs.common.types import InstanceStatus


@dataclass(frozen=True)
class KunServeParams:
    interval_s: float = 0.1  # the monitor's period (the scheduler's rescheduling interval)
    window_s: float = 1.0  # samples the forecast fits
    horizon_s: float = 1.0  # §4.3: drop when throttling is predicted within one second
    hop_ms: float = 0.05  # activations of a micro-batch from one stage to the next
    pipeline_overhead: float = 0.2  # step time x (1 + this) in a group (paper §5.1: 12.6-21.8% less throughput)
    remote_attention_overhead: float = 0.5  # step time x (1 + this) while the KV exchange is under way
    restore_margin: float = 0.2  # restore once each member's requirement fits (1 - this) of its own memory
    min_group_s: float = 5.0  # and the group is at least this old (no drop/restore flapping)
    reload_gbps: float = 200.0  # parameters and the remote KV back: host memory or a peer over RDMA
    max_group_size: int | None = None
    static_group_size: int = 0  # > 1: the static pipeline baseline (groups from the start, never restored)

    def validate(self) -> None:
        for name in ("interval_s", "window_s", "horizon_s", "reload_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if min(self.hop_ms, self.remote_attention_overhead, self.pipeline_overhead) < 0 or not 0 <= self.restore_margin < 1:
            raise ValueError(f"invalid KunServe parameters {self}")
        if self.static_group_size == 1 or self.static_group_size < 0:
            raise ValueError(f"static_group_size must be 0 (off) or at least 2, got {self.static_group_size}")


def layer_blocks(profile) -> int:
    """One layer's parameter memory in whole KV blocks (rounded down: a
    drop never lends more than it frees)."""
    if profile.param_bytes <= 0 or profile.num_layers <= 0:
        raise ValueError(f"profile {profile.name!r} has no param_bytes/num_layers: KunServe needs both")
    per_block = profile.kv_bytes_per_token * profile.block_size
    return int(profile.param_bytes / profile.num_layers // per_block)


@dataclass
class Group:
    gid: int
    plan: BuddyGroup
    members: list[SimInstance]
    formed_at: float
    exchange_until: float
    static: bool = False
    state: str = "pipeline"  # pipeline | draining | reloading
    events: list[dict] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.members)


class KunServe:
    """The drop/restore controller on one simulated cluster (see the module doc)."""

    def __init__(self, cluster, params: KunServeParams):
        params.validate()
        self.c = cluster
        self.k = cluster.k
        self.p = params
        self.profile = cluster.profile
        self.layer_blocks = layer_blocks(self.profile)
        self.num_layers = self.profile.num_layers
        self.bytes_per_block = self.profile.kv_bytes_per_token * self.profile.block_size
        self.samples: dict[str, deque[MemorySample]] = {}
        self.groups: dict[str, Group] = {}  # iid -> its group
        self.own_blocks: dict[str, int] = {}  # iid -> its pool without lent memory
        self._gids = 0
        self.log: list[dict] = []
        self.pipelined_s = 0.0  # instance-seconds in a group (dissolved groups)
        if params.static_group_size:
            self.k.at(self.k.now, self._static_groups)
        else:
            self.k.at(self.k.now + params.interval_s, self._tick)

    # --- the monitor ------------------------------------------------------------------------
    def _tick(self) -> None:
        now = self.k.now
        for iid, st in self.c.scheduler.statuses.items():
            self._sample(iid, st, now)
        for g in self._live_groups():
            if g.state == "pipeline" and not g.static:
                self._maybe_restore(g, now)
        free = {iid: s for iid, s in self.samples.items() if iid not in self.groups and s}
        if free:
            fc = predict_throttle(free, self.p.horizon_s)
            if fc.throttled:
                self._plan(fc, now)
        self._maybe_merge(now)
        if self.c.recorder.done < len(self.c.work.requests):
            self.k.after(self.p.interval_s, self._tick)

    def _sample(self, iid: str, st: InstanceStatus, now: float) -> None:
        add_sample(self.samples.setdefault(iid, deque()), st, now, self.p.window_s)
        self.own_blocks.setdefault(iid, st.total_blocks)

    def _plan(self, fc, now: float) -> None:
        deficits = {f.instance_id: f.deficit_blocks for f in fc.instances}
        cands = []
        for iid, st in sorted(self.c.scheduler.statuses.items()):
            inst = self.c.instances[iid]
            cands.append(Candidate(iid, st.free_blocks, deficits.get(iid, 0),
                                   eligible=iid not in self.groups and not inst.stopped and not inst.terminating))
        plan = plan_buddy_groups(cands, fc.deficit_blocks, self.num_layers, self.layer_blocks,
                                 self.p.max_group_size)
        for bg in plan.groups:
            self._form(bg, now, static=False)
        if plan.groups:
            self.log.append({"t": now - self.c.t0, "event": "drop", "needed_blocks": plan.needed_blocks,
                             "freed_blocks": plan.freed_blocks, "covered": plan.covered,
                             "groups": [[m.instance_id for m in g.members] for g in plan.groups]})

    def _maybe_merge(self, now: float) -> None:
        """A group throttled again merges with the group that has the most
        free memory (Algorithm 1 goes on merging groups while memory is
        short): one replica's parameters more are freed per merge. One
        merge per tick; groups still exchanging KV, restoring, or static
        are left alone."""
        settled = [g for g in self._live_groups()
                   if g.state == "pipeline" and not g.static and now >= g.exchange_until]
        if len(settled) < 2:
            return
        cap = min(self.num_layers, self.p.max_group_size or self.num_layers)
        statuses = self.c.scheduler.statuses
        for g in settled:
            q = {i.instance_id: self.samples.get(i.instance_id) for i in g.members}
            if not all(q.values()) or not predict_throttle(q, self.p.horizon_s).throttled:
                continue
            partners = [h for h in settled if h is not g and g.size + h.size <= cap]
            if not partners:
                return
            h = max(partners, key=lambda h: (sum(statuses[i.instance_id].free_blocks for i in h.members
                                                 if i.instance_id in statuses), -h.gid))
            self._merge(g, h, now)
            return

    def _merge(self, g: Group, h: Group, now: float) -> None:
        members = g.members + h.members
        before = {m.instance_id: m.freed_blocks for m in g.plan.members + h.plan.members}
        plan = buddy_group([i.instance_id for i in members], self.num_layers, self.layer_blocks)
        exchange_s = self._exchange_s(members)
        self._gids += 1
        merged = Group(self._gids, plan, members, now, now + exchange_s)
        merged.events = g.events + h.events + [{"t": now - self.c.t0, "event": "merge", "exchange_s": exchange_s}]
        self.pipelined_s += g.size * (now - g.formed_at) + h.size * (now - h.formed_at)
        for m, inst in zip(plan.members, members):
            self.groups[inst.instance_id] = merged
            inst.submit(self._drop, inst, merged, m.freed_blocks - before[inst.instance_id])
        self.log.append({"t": now - self.c.t0, "event": "merge", "groups": [[i.instance_id for i in g.members],
                                                                             [i.instance_id for i in h.members]],
                         "freed_blocks": plan.freed_blocks - sum(before.values())})

    # --- drop and the exchange ---------------------------------------------------------------
    def _static_groups(self) -> None:
        ids = sorted(self.c.instances)
        k = self.p.static_group_size
        for i in range(0, len(ids) - k + 1, k):
            self._form(buddy_group(ids[i:i + k], self.num_layers, self.layer_blocks), self.k.now, static=True)

    def _form(self, bg: BuddyGroup, now: float, static: bool) -> None:
        members = [self.c.instances[m.instance_id] for m in bg.members]
        self._gids += 1
        exchange_s = self._exchange_s(members)
        g = Group(self._gids, bg, members, now, now + exchange_s, static=static)
        g.events.append({"t": now - self.c.t0, "event": "drop", "exchange_s": exchange_s})
        for m, inst in zip(bg.members, members):
            self.own_blocks.setdefault(inst.instance_id, inst.engine.pool.capacity)
            self.groups[inst.instance_id] = g
            inst.submit(self._drop, inst, g, m.freed_blocks)

    def _drop(self, inst: SimInstance, g: Group, freed: int) -> None:
        """Between steps on the member's engine: the freed parameter memory
        becomes KV blocks, and its steps run as a pipeline stage."""
        inst.engine.grow_blocks(freed)
        inst.executor.stretch = lambda ms, inst=inst, g=g: self._stretch(g, inst, ms)
        inst.poke()

    def _exchange_s(self, members: list[SimInstance]) -> float:
        """(k-1)/k of each member's KV goes to the members now holding those
        layers; every member sends and receives at once over its own link."""
        k = len(members)
        return max(self._used_blocks(inst) * self.bytes_per_block * (k - 1) / k / self._link_bytes_per_s()
                   for inst in members)

    def _live_groups(self) -> list[Group]:
        return list({id(g): g for g in self.groups.values()}.values())

    def _used_blocks(self, inst: SimInstance) -> int:
        pool = inst.engine.pool
        return pool.capacity - pool.num_free - pool.num_reserved

    def _link_bytes_per_s(self) -> float:
        return self.c.migration.transfer.bandwidth_bytes_per_s

    def _stretch(self, g: Group, inst: SimInstance, ms: float) -> float:
        """A member's step as a pipeline stage: its own batch's time, the
        pipeline's overhead, the activation hops; slower while the KV
        exchange runs (remote attention)."""
        out = ms * (1.0 + self.p.pipeline_overhead) + (g.size - 1) * self.p.hop_ms
        if self.k.now < g.exchange_until:
            out *= 1.0 + self.p.remote_attention_overhead
        return out

    # --- restore -----------------------------------------------------------------------------
    def _maybe_restore(self, g: Group, now: float) -> None:
        if now - g.formed_at < self.p.min_group_s or now < g.exchange_until:
            return
        for inst in g.members:
            iid = inst.instance_id
            if not fits_own_memory(iid, self.samples.get(iid) or (), self.own_blocks[iid], self.p.restore_margin,
                                   self.p.horizon_s):
                return
        g.state = "draining"
        g.events.append({"t": now - self.c.t0, "event": "restore"})
        for m, inst in zip(g.plan.members, g.members):
            inst.submit(inst.engine.pool.shrink, m.freed_blocks)
        self.k.after(self.p.interval_s, self._drained, g)

    def _drained(self, g: Group) -> None:
        """Once every member's pool gave its lent blocks back, the dropped
        parameters and the KV held by peers come back over the link."""
        if any(inst.engine.pool.shrinking or inst.engine.pool.capacity > self.own_blocks[inst.instance_id]
               for inst in g.members):
            self.k.after(self.p.interval_s, self._drained, g)
            return
        g.state = "reloading"
        k = g.size
        reload_s = max((m.freed_blocks + self._used_blocks(inst) * (k - 1) / k) * self.bytes_per_block
                       / (self.p.reload_gbps * 1e9 / 8) for m, inst in zip(g.plan.members, g.members))
        g.events.append({"t": self.k.now - self.c.t0, "event": "reload", "reload_s": reload_s})
        self.k.after(reload_s, self._dissolve, g)

    def _dissolve(self, g: Group) -> None:
        self.pipelined_s += g.size * (self.k.now - g.formed_at)
        for inst in g.members:
            inst.executor.stretch = None
            self.groups.pop(inst.instance_id, None)
            inst.poke()
        g.events.append({"t": self.k.now - self.c.t0, "event": "dissolved"})
        self.log.append({"t": self.k.now - self.c.t0, "event": "restored",
                         "group": [i.instance_id for i in g.members], "events": g.events})

    # --- results -------------------------------------------------------------------------------
    def summary(self) -> dict:
        drops = [e for e in self.log if e["event"] == "drop"]
        merges = [e for e in self.log if e["event"] == "merge"]
        restores = [e for e in self.log if e["event"] == "restored"]
        open_ = self._live_groups()
        return {"layer_blocks": self.layer_blocks, "param_blocks": self.layer_blocks * self.num_layers,
                "drops": len(drops), "merges": len(merges), "groups_formed": self._gids,
                "restores": len(restores), "freed_blocks": sum(e["freed_blocks"] for e in drops + merges),
                "uncovered_drops": sum(not e["covered"] for e in drops),
                "groups_at_end": len(open_),
                "pipelined_instance_s": self.pipelined_s + sum(g.size * (self.k.now - g.formed_at) for g in open_),
                "params": asdict(self.p), "log": self.log}
