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
- **drop** when the instances outside groups are about to throttle
  (``predict_throttle``): ``plan_buddy_groups`` picks groups; each member
  enters the pipeline (``SetPipeline``: its peers receive the KV of their
  layers for its running requests), then drops the layers it does not keep
  (``DropLayers``: its KV pool grows).

Not here yet (so not in the simulator either): merging a group throttled
again with another, and restore by live migration (members take the KV back
in place).

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
    plan_buddy_groups,
    predict_throttle,
)
from services.scheduler.state import LeaderState, MemoryState

log = get_logger(__name__)

DROPS = Counter("ferry_kunserve_drops_total", "buddy groups formed (layers dropped into KV memory)")
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
        for i in g.ids:
            self.groups[i] = g
        await self.state.put("kunserve", g.key, g.to_json())
        DROPS.inc()
        GROUPS.set(len(self._live_groups()))
        FREED.inc(plan.freed_blocks)
        end = time.perf_counter()
        self.log.append({"t": g.formed_at, "event": "drop", "members": g.ids, "freed_blocks": plan.freed_blocks,
                         "took_s": end - t0, "prepare_s": prepared_at - t0, "drop_s": dropped_at - prepared_at,
                         "enter_s": end - dropped_at})
        log.info("kunserve: group formed", members=g.ids, freed_blocks=plan.freed_blocks,
                 layers=[(m.start, m.end) for m in plan.members], took_ms=round((end - t0) * 1000, 1),
                 prepare_ms=round((prepared_at - t0) * 1000, 1), drop_ms=round((dropped_at - prepared_at) * 1000, 1),
                 enter_ms=round((end - dropped_at) * 1000, 1))
        return g

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
