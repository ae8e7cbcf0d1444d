"""KunServe's monitor in the scheduler (``--kunserve``; docs/kunserve.md), on
the pure decisions of libs/common/policies/kunserve.py. The simulator runs
this same loop on its virtual clock (ferry/sim/kunserve.py: simulated
instances behind the same InstanceClient, libs/common/instance_client.py).

Every ``interval_s`` it reads the cluster view's status reports into a
window per instance (``add_sample``), then:

- **restore** each group older than ``min_group_s`` whose every member's
  requirement fits its own memory (``fits_own_memory``): each member fetches
  the layers it dropped from the members that hold them (``RestoreLayers``)
  and leaves the pipeline, taking back the KV its peers held
  (``SetPipeline`` to every layer);
- **merge** groups throttled again (``merge_throttled``): a formed group
  whose members' forecast (``predict_throttle`` over their own samples,
  which carry the grown pools) is still throttled merges with another
  (``merge_groups``: each member keeps part of its range and drops the rest,
  ``DropLayers``; then every member sets the new stages, ``SetPipeline``),
  until the merges cover the deficit (one replica's parameters, P, per
  merge) or no merge is possible;
- **drop** when the instances outside groups are about to throttle
  (``predict_throttle``): ``plan_buddy_groups`` picks groups; each member
  drops the layers it does not keep (``DropLayers``: its KV pool grows),
  then enters the pipeline (``SetPipeline``: its peers receive the KV of
  their layers for its running requests).

Merging, against the paper's Algorithm 1 (§4.1: "iteratively merge groups
with the smallest size until the memory constraint is met"):
- As there: merges continue while the freed memory is short of the deficit
  R, each merge freeing exactly P (a group of k keeps one copy), and the
  smallest groups merge first; a merged group may merge again in the same
  round while R is not covered.
- Different: Algorithm 1 pops the two smallest groups of the cluster,
  whichever they are, because KunServe pools a group's memory and its
  dispatcher rebalances the overflow. Here a member's requests use only its
  own pool, so memory freed in two groups that are not throttled would not
  admit the throttled group's queue: one of the two is always a throttled
  group (the smallest, the most short on equal sizes), the other the
  smallest other group (the one with the most free blocks on equal sizes).
- Different: the algorithm is a plan from scratch; here groups already run,
  so a merge keeps every member within the layers it holds (it only drops,
  never fetches parameters back). A group is considered only once every
  member has reported since it last changed (its pool grown), so that one
  throttled window does not merge twice; ``max_group_size`` and one layer a
  stage bound the merged size.
- A merge's first round prepares the grown storage and holds every
  member's steps (nothing changed yet), so that no member's step reaches a
  peer that has dropped the layers it runs for it; the second drops; the
  third sets the new stages, and each member moves its requests' KV of the
  layers whose holder changed, with a pause (``NativeEngine._regroup``),
  and stays held (``hold``), so that no member's step is in the way of
  another's moves; the fourth sets the same stages again, which ends the
  holds.
  A refusal in the first round leaves both groups as they were (their
  stages set again end the holds) and marks them not to be merged again;
  a failure after that takes the dropped layers back from the members that
  keep them and sets the old stages again.

Not here yet: restore by live migration (members take the KV back in
place).

The planner needs the model's layer count and one layer's parameter memory
in KV blocks (``--kunserve-layers``, ``--kunserve-layer-blocks``): instances
do not report them. Counters and gauges are Prometheus metrics
(``ferry_kunserve_*``), exported where the process serves /metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from libs.common.errors import FerryError
from libs.common.instance_client import GrpcInstanceClients, InstanceClients
from libs.common.logging import get_logger
from libs.common.policies.kunserve import (
    BuddyGroup,
    Candidate,
    Member,
    MemorySample,
    add_sample,
    fits_own_memory,
    merge_groups,
    plan_buddy_groups,
    predict_throttle,
)
from services.scheduler.state import LeaderState, MemoryState

log = get_logger(__name__)

DROPS = Counter("ferry_kunserve_drops_total", "buddy groups formed (layers dropped into KV memory)")
MERGES = Counter("ferry_kunserve_merges_total", "buddy groups throttled again, merged with another")
RESTORES = Counter("ferry_kunserve_restores_total", "buddy groups restored (layers and KV back)")
FAILURES = Counter("ferry_kunserve_failures_total", "group formations or restores that failed", ["action"])
GROUPS = Gauge("ferry_kunserve_groups", "buddy groups serving as pipelines now")
FREED = Gauge("ferry_kunserve_freed_blocks", "KV blocks lent by dropped layers now")


@dataclass(frozen=True)
class KunServeConfig:
    num_layers: int
    layer_blocks: int  # one layer's parameter memory in KV blocks
    interval_s: float = 0.1
    window_s: float = 1.0
    horizon_s: float = 1.0
    restore_margin: float = 0.2
    min_group_s: float = 5.0
    max_group_size: int | None = None
    pause_exchange: bool = False  # members move their running requests' KV in a pause, not live


@dataclass
class LiveGroup:
    plan: BuddyGroup
    addresses: dict[str, str]
    formed_at: float
    own_blocks: dict[str, int]  # each member's pool before the drop
    events: list[str] = field(default_factory=list)
    changed_at: float = 0.0  # when its members' layers last changed (formed or merged)
    mergeable: bool = True  # False once a member refused to re-form (it cannot regroup live)

    @property
    def ids(self) -> list[str]:
        return [m.instance_id for m in self.plan.members]

    @property
    def key(self) -> str:
        return "+".join(self.ids)

    def to_json(self) -> dict:
        """What the next leader needs to restore the group (leader state)."""
        return {"members": [[m.instance_id, m.start, m.end, m.freed_blocks] for m in self.plan.members],
                "addresses": self.addresses, "formed_at": self.formed_at, "own_blocks": self.own_blocks}

    @classmethod
    def from_json(cls, d: dict) -> "LiveGroup":
        members = tuple(Member(str(i), int(s), int(e), int(f)) for i, s, e, f in d["members"])
        return cls(BuddyGroup(members), dict(d["addresses"]), float(d["formed_at"]),
                   {k: int(v) for k, v in d["own_blocks"].items()})


async def _all(calls) -> None:
    """Run the calls at once; after all of them ended, raise the first error."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


def dropped_ranges(num_layers: int, start: int, end: int) -> list[range]:
    """The layers a member keeping [start, end) drops: before and after."""
    return [r for r in (range(start), range(end, num_layers)) if len(r)]


def holders(plan: BuddyGroup, layers: range) -> list[tuple[range, str]]:
    """Which members keep which part of ``layers``: (sub-range, instance)."""
    out = []
    for m in plan.members:
        lo, hi = max(layers.start, m.start), min(layers.stop, m.end)
        if lo < hi:
            out.append((range(lo, hi), m.instance_id))
    return out


class KunServeLoop:
    def __init__(self, view, config: KunServeConfig, clients: InstanceClients | None = None, clock=time.time,
                 state: LeaderState | None = None):
        """``view``: the scheduler's ClusterView (``views()``, ``address()``);
        ``clients``: how it reaches the instances (the scheduler's; else its
        own over gRPC, closed by ``stop``); ``state``: where the groups
        outlive this leader (wall-clock times)."""
        self.view = view
        self.state = state or MemoryState()
        self.cfg = config
        self.clock = clock
        self._own_clients = clients is None
        self.clients = GrpcInstanceClients() if clients is None else clients
        self.samples: dict[str, deque[MemorySample]] = {}
        self.groups: dict[str, LiveGroup] = {}  # member -> its group
        self.log: list[dict] = []
        self._task: asyncio.Task | None = None

    def _client(self, g: "LiveGroup", instance_id: str):
        return self.clients(instance_id, g.addresses[instance_id])

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def adopt(self) -> None:
        """The groups a previous leader formed and did not restore: this one
        restores them when their pressure ends."""
        for key, d in (await self.state.load("kunserve")).items():
            try:
                g = LiveGroup.from_json(d)
            except (KeyError, TypeError, ValueError) as e:
                log.warning("kunserve: unreadable group in the leader state; ignored", key=key, error=repr(e))
                continue
            for i in g.ids:
                self.groups[i] = g
            log.info("kunserve: group taken over", members=g.ids)
        GROUPS.set(len(self._live_groups()))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._own_clients:
            await self.clients.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the loop must go on
                log.error("kunserve tick failed", error=repr(e))

    # --- one tick ---------------------------------------------------------------------------
    def _live_groups(self) -> list[LiveGroup]:
        return list({id(g): g for g in self.groups.values()}.values())

    async def tick(self) -> None:
        now = self.clock()
        statuses = {v.instance_id: v.status for v in self.view.views()}
        for iid in list(self.samples):
            if iid not in statuses:  # gone: forget it
                del self.samples[iid]
        for iid, st in statuses.items():
            add_sample(self.samples.setdefault(iid, deque()), st, now, self.cfg.window_s)
        for g in self._live_groups():
            if now - g.formed_at >= self.cfg.min_group_s and all(
                    fits_own_memory(i, self.samples.get(i) or (), g.own_blocks[i], self.cfg.restore_margin,
                                    self.cfg.horizon_s) for i in g.ids):
                await self.restore(g)
        await self.merge_throttled(statuses)
        outside = {iid: q for iid, q in self.samples.items() if q and iid not in self.groups}
        if not outside:
            return
        fc = predict_throttle(outside, self.cfg.horizon_s)
        if not fc.throttled:
            return
        deficits = {f.instance_id: f.deficit_blocks for f in fc.instances}
        cands = [Candidate(iid, st.free_blocks, deficits.get(iid, 0),
                           eligible=iid not in self.groups and not st.terminating and self.view.address(iid) is not None)
                 for iid, st in sorted(statuses.items())]
        plan = plan_buddy_groups(cands, fc.deficit_blocks, self.cfg.num_layers, self.cfg.layer_blocks,
                                 self.cfg.max_group_size)
        for bg in plan.groups:
            await self.form(bg, {i: statuses[i].total_blocks for i in (m.instance_id for m in bg.members)})

    def _settled(self, g: LiveGroup) -> bool:
        """Every member has reported since the group last changed (its pool grown)."""
        return all((q := self.samples.get(i)) and q[-1].time > g.changed_at for i in g.ids)

    async def merge_throttled(self, statuses: dict) -> int:
        """Algorithm 1 goes on merging (module doc): while formed groups are
        throttled again, merge the smallest throttled group with the smallest
        other one, each merge covering one replica's parameters of the
        deficit, until it is covered or no merge is possible. Returns the
        merges made."""
        groups = [g for g in self._live_groups() if g.mergeable and self._settled(g)]
        deficit: dict[int, int] = {}
        for g in groups:
            fc = predict_throttle({i: self.samples[i] for i in g.ids}, self.cfg.horizon_s)
            if fc.throttled:
                deficit[id(g)] = fc.deficit_blocks
        need = sum(deficit.values())
        param_blocks = self.cfg.num_layers * self.cfg.layer_blocks
        cap = min(self.cfg.num_layers, self.cfg.max_group_size or self.cfg.num_layers)

        def free(g: LiveGroup) -> int:
            return sum(statuses[i].free_blocks for i in g.ids if i in statuses)

        merges = 0
        while need > 0:
            pick = None
            for g in sorted((g for g in groups if id(g) in deficit),
                            key=lambda g: (len(g.ids), -deficit[id(g)], g.key)):
                for h in sorted((h for h in groups if h is not g and len(g.ids) + len(h.ids) <= cap),
                                key=lambda h: (len(h.ids), -free(h), h.key)):
                    plan = merge_groups(g.plan, h.plan, self.cfg.num_layers, self.cfg.layer_blocks)
                    if plan is not None:
                        pick = g, h, plan
                        break
                if pick:
                    break
            if pick is None:
                break
            g, h, plan = pick
            groups = [x for x in groups if x is not g and x is not h]
            merged = await self.merge(g, h, plan)
            if merged is None:
                continue  # refused: both stay as they were; try the others
            merges += 1
            need -= param_blocks
            rest = deficit.pop(id(g), 0) + deficit.pop(id(h), 0) - param_blocks
            groups.append(merged)
            if rest > 0:
                deficit[id(merged)] = rest
        return merges

    # --- actions ----------------------------------------------------------------------------
    async def form(self, plan: BuddyGroup, own_blocks: dict[str, int]) -> LiveGroup | None:
        """Every member drops the layers it does not keep and holds its steps
        (its pool grows), then every member enters the pipeline: its peers,
        with room now, get the KV of their layers, and it steps again. The
        members drop at once and enter at once: a member holds its steps from
        its own drop until it enters, so that is as short as the slowest
        member's drop. On a failure, every member takes its layers back."""
        addresses = {m.instance_id: self.view.address(m.instance_id) for m in plan.members}
        g = LiveGroup(plan, addresses, self.clock(), own_blocks)
        t0 = time.perf_counter()
        async def drop(m, prepare=False):
            for r in dropped_ranges(self.cfg.num_layers, m.start, m.end):
                await self._client(g, m.instance_id).drop_layers(r, hold=not prepare, prepare=prepare)

        async def enter(m):
            peers = [(range(o.start, o.end), addresses[o.instance_id]) for o in plan.members if o is not m]
            await self._client(g, m.instance_id).set_pipeline(range(m.start, m.end), peers, self.cfg.pause_exchange)

        try:
            await _all(drop(m, prepare=True) for m in plan.members)  # storage ready, no step held yet
            prepared_at = time.perf_counter()
            await _all(drop(m) for m in plan.members)
            dropped_at = time.perf_counter()
            await _all(enter(m) for m in plan.members)
        except FerryError as e:
            FAILURES.labels("drop").inc()
            log.error("kunserve: forming a group failed", members=g.ids, error=str(e))
            for m in plan.members:
                try:
                    await self._restore_member(g, m)
                except FerryError as e2:
                    log.error("kunserve: undoing a member failed", member=m.instance_id, error=str(e2))
            return None
        await self._serving(g, plan.freed_blocks)
        DROPS.inc()
        end = time.perf_counter()
        self.log.append({"t": g.formed_at, "event": "drop", "members": g.ids, "freed_blocks": plan.freed_blocks,
                         "took_s": end - t0, "prepare_s": prepared_at - t0, "drop_s": dropped_at - prepared_at,
                         "enter_s": end - dropped_at})
        log.info("kunserve: group formed", members=g.ids, freed_blocks=plan.freed_blocks,
                 layers=[(m.start, m.end) for m in plan.members], took_ms=round((end - t0) * 1000, 1),
                 prepare_ms=round((prepared_at - t0) * 1000, 1), drop_ms=round((dropped_at - prepared_at) * 1000, 1),
                 enter_ms=round((end - dropped_at) * 1000, 1))
        return g

    async def merge(self, g: LiveGroup, h: LiveGroup, plan: BuddyGroup) -> LiveGroup | None:
        """Two groups become one with ``plan``'s stages (``merge_groups``:
        each member keeps part of its range). In four rounds: every member
        prepares the grown storage and holds its steps (nothing changes
        yet); drops the layers it no longer keeps; sets the new stages (the
        KV of the layers that moved goes to their new holders) and stays
        held; sets them again, which releases it. A refusal in the first
        round leaves both groups as they were (the old stages set again end
        the holds), marked not to merge again; a failure later takes the
        dropped layers back from the members that keep them and sets the old
        stages."""
        addresses = {**g.addresses, **h.addresses}
        old = {m.instance_id: (m, grp) for grp in (g, h) for m in grp.plan.members}
        merged = LiveGroup(plan, addresses, self.clock(), {**g.own_blocks, **h.own_blocks})
        extra = {m.instance_id: [r for r in (range(old[m.instance_id][0].start, m.start),
                                             range(m.end, old[m.instance_id][0].end)) if len(r)]
                 for m in plan.members}
        dropped: dict[str, list[range]] = {i: [] for i in extra}  # what to take back if it fails
        t0 = time.perf_counter()

        async def drop(m, prepare):
            client = self._client(merged, m.instance_id)
            if prepare and not extra[m.instance_id]:  # it drops nothing, but holds too
                await client.drop_layers(range(m.start, m.start), hold=True, prepare=True)
            for r in extra[m.instance_id]:  # a first round holds the member's steps from its end
                await client.drop_layers(r, hold=True, prepare=prepare)
                if not prepare:
                    dropped[m.instance_id].append(r)

        async def enter(m, grp: LiveGroup, hold: bool = False):
            peers = [(range(o.start, o.end), addresses[o.instance_id]) for o in grp.plan.members
                     if o.instance_id != m.instance_id]
            await self._client(merged, m.instance_id).set_pipeline(range(m.start, m.end), peers,
                                                                   self.cfg.pause_exchange, hold)

        try:
            await _all(drop(m, True) for m in plan.members)
        except FerryError as e:
            FAILURES.labels("merge").inc()
            g.mergeable = h.mergeable = False
            log.warning("kunserve: a member refused to re-form its group; these groups will not merge",
                        groups=[g.ids, h.ids], error=str(e))
            for m_old, grp in old.values():  # the same stages again: those that hold step again
                try:
                    await enter(m_old, grp)
                except FerryError as e2:
                    log.error("kunserve: releasing a member's hold failed", member=m_old.instance_id, error=str(e2))
            return None
        try:
            await _all(drop(m, False) for m in plan.members)
            await _all(enter(m, merged, hold=True) for m in plan.members)  # each moves its KV, all held
            await _all(enter(m, merged) for m in plan.members)  # the same stages again: all step again
        except FerryError as e:
            FAILURES.labels("merge").inc()
            g.mergeable = h.mergeable = False
            log.error("kunserve: merging groups failed; undoing", groups=[g.ids, h.ids], error=str(e))
            for m in plan.members:
                try:
                    for r in dropped[m.instance_id]:
                        for part, holder in holders(plan, r):
                            await self._client(merged, m.instance_id).restore_layers(part, addresses[holder])
                    m_old, grp = old[m.instance_id]
                    await enter(m_old, grp)
                except FerryError as e2:
                    log.error("kunserve: undoing a member's merge failed", member=m.instance_id, error=str(e2))
            return None
        freed = plan.freed_blocks - g.plan.freed_blocks - h.plan.freed_blocks
        await self._serving(merged, freed, replaces=(g, h))
        MERGES.inc()
        took = time.perf_counter() - t0
        self.log.append({"t": merged.formed_at, "event": "merge", "members": merged.ids, "groups": [g.ids, h.ids],
                         "freed_blocks": freed, "took_s": took})
        log.info("kunserve: groups merged", members=merged.ids, groups=[g.ids, h.ids], freed_blocks=freed,
                 layers=[(m.start, m.end) for m in plan.members], took_ms=round(took * 1000, 1))
        return merged

    async def _serving(self, g: LiveGroup, freed_blocks: int, replaces: tuple[LiveGroup, ...] = ()) -> None:
        """``g`` serves as a pipeline now (formed, or merged from ``replaces``):
        its members point at it, the leader state holds it instead of them."""
        g.changed_at = self.clock()
        for i in g.ids:
            self.groups[i] = g
        for old in replaces:
            await self.state.delete("kunserve", old.key)
        await self.state.put("kunserve", g.key, g.to_json())
        GROUPS.set(len(self._live_groups()))
        FREED.inc(freed_blocks)

    async def _restore_member(self, g: LiveGroup, m) -> None:
        client = self._client(g, m.instance_id)
        t0 = time.perf_counter()
        for r in dropped_ranges(self.cfg.num_layers, m.start, m.end):
            for part, holder in holders(g.plan, r):
                await client.restore_layers(part, g.addresses[holder])
        t1 = time.perf_counter()
        await client.set_pipeline(range(self.cfg.num_layers))
        log.info("kunserve: member restored", member=m.instance_id, layers_ms=round((t1 - t0) * 1000, 1),
                 kv_back_ms=round((time.perf_counter() - t1) * 1000, 1))

    async def restore(self, g: LiveGroup) -> bool:
        """Each member takes its layers back from those that keep them, then
        the KV its peers held; the group dissolves."""
        t0 = time.perf_counter()
        try:
            for m in g.plan.members:
                await self._restore_member(g, m)
        except FerryError as e:
            FAILURES.labels("restore").inc()
            log.error("kunserve: restoring a group failed (tried again next tick)", members=g.ids, error=str(e))
            return False
        for i in g.ids:
            self.groups.pop(i, None)
        await self.state.delete("kunserve", g.key)
        RESTORES.inc()
        GROUPS.set(len(self._live_groups()))
        FREED.dec(g.plan.freed_blocks)
        took = time.perf_counter() - t0
        self.log.append({"t": self.clock(), "event": "restore", "members": g.ids, "took_s": took})
        log.info("kunserve: group restored", members=g.ids, after_s=round(self.clock() - g.formed_at, 2),
                 took_ms=round(took * 1000, 1))
        return True
