"""Auto-scaling (docs/design.md §5, Llumnix §4.4.3): keep the mean normal-priority
freeness of the live, non-terminating instances within [x, y] over a window.

- below x for the window (and fewer than max instances): launch one instance,
  or with ``max_launch`` > 1 as many as the freeness shortfall asks for (see
  ``launch_count``), launched together as one action; the rescheduler pairs
  the empty newcomers as migration destinations at once, so they fill by
  migration, not only by new dispatches;
- above y for the window (and more than min instances): mark the instance with
  the fewest running requests terminating — its fake request of infinite
  virtual usage makes it a migration source and drains it — and stop it
  through the launcher once it reports no running or waiting request;
- fewer than min instances (a crash): launch at once, without a window.

``decide`` is the pure policy (no I/O), unit tested on hand-made windows;
``Autoscaler`` is the loop in the scheduler that samples the cluster view,
calls ``decide`` and carries decisions out."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from libs.common.backoff import RestartBackoff
from libs.common.errors import FerryError
from libs.common.instance_client import GrpcInstanceClients, InstanceClients
from libs.common.load import is_finite
from libs.common.logging import get_logger
from libs.common.types import Priority, RequestPhase
from services.scheduler.state import LeaderState, MemoryState

log = get_logger(__name__)

NONE, SCALE_OUT, SCALE_IN = "none", "scale_out", "scale_in"


@dataclass(frozen=True)
class AutoscalePolicy:
    scale_out_below: float = 10.0  # x
    scale_in_above: float = 60.0  # y
    window_s: float = 10.0
    min_instances: int = 1
    max_instances: int = 8
    cooldown_s: float = 10.0
    min_coverage: float = 0.8  # the window must hold samples spanning this fraction of window_s
    # Most instances one scale-out launches. 1 (Llumnix): one per action. More:
    # sized by the shortfall, so that a fleet far below x does not climb one
    # launch + cooldown + window at a time.
    max_launch: int = 1


@dataclass(frozen=True)
class InstanceSample:
    instance_id: str
    normal_freeness: float
    num_running: int = 0
    num_waiting: int = 0
    terminating: bool = False
    pending_requests: int = 0  # dispatched, not yet reported
    total_blocks: int = 0  # M: the KV blocks of the instance (0: unknown)
    normal_batch: int = 0  # B: normal-priority requests running (freeness = (M - usage) / max(1, B))


@dataclass(frozen=True)
class Snapshot:
    t: float
    instances: tuple[InstanceSample, ...]

    def live(self) -> list[InstanceSample]:
        return [i for i in self.instances if not i.terminating]

    def mean_freeness(self) -> float | None:
        vals = [i.normal_freeness for i in self.live() if is_finite(i.normal_freeness)]
        return sum(vals) / len(vals) if vals else None


@dataclass(frozen=True)
class Decision:
    action: str = NONE
    instance_id: str | None = None
    reason: str = ""
    mean_freeness: float | None = None
    count: int = 1  # scale-out: instances to launch


def launch_count(snap: Snapshot, target: float) -> int:
    """Instances to add so that the mean normal freeness comes back to
    ``target`` once the load spreads over them (at least 1).

    Freeness is F = (M - U) / max(1, B), so F x max(1, B) = M - U is an
    instance's spare memory (negative when its demand exceeds it). With k
    more instances and the same requests spread evenly, the freeness is about
    ((n + k) M - sum U) / sum B; setting it to ``target``:
    k = (target x sum max(1, B) - sum F max(1, B)) / M. An estimate: freeness
    counts virtual usage (queued demand included), not the future load."""
    live = [i for i in snap.live() if i.total_blocks > 0 and is_finite(i.normal_freeness)]
    if not live:
        return 1
    m = sum(i.total_blocks for i in live) / len(live)
    spare = sum(i.normal_freeness * max(1, i.normal_batch) for i in live)
    batch = sum(max(1, i.normal_batch) for i in live)
    return max(1, math.ceil((target * batch - spare) / m))


def decide(window: Sequence[Snapshot], policy: AutoscalePolicy, *, now: float,
           last_action_at: float | None = None, launching: int = 0, draining: int = 0,
           stoppable: frozenset[str] | None = None) -> Decision:
    """What to do now, given snapshots (oldest first) of the cluster.

    ``launching``: instances being started (counted as live); ``draining``:
    instances marked terminating by us and not yet stopped. One action at a
    time: nothing happens while a launch or a drain is under way, nor within
    ``cooldown_s`` of the last action. Samples older than the last action do
    not count (the fleet changed). ``stoppable``: the instances a scale-in may
    pick (those the launcher can stop); None means any."""
    if not window:
        return Decision(reason="no samples")
    latest = window[-1]
    live = latest.live()
    n = len(live) + launching
    if n < policy.min_instances and not launching:
        return Decision(SCALE_OUT, reason=f"{n} live < min {policy.min_instances}")
    if launching or draining:
        return Decision(reason="an action is under way")
    if last_action_at is not None and now - last_action_at < policy.cooldown_s:
        return Decision(reason="cooldown")
    start = now - policy.window_s
    if last_action_at is not None:
        start = max(start, last_action_at)
    recent = [s for s in window if s.t >= start and s.t <= now]
    means = [m for m in (s.mean_freeness() for s in recent) if m is not None]
    if not means or now - recent[0].t < policy.min_coverage * policy.window_s:
        return Decision(reason="window not full")
    mean = sum(means) / len(means)
    if mean < policy.scale_out_below:
        if n >= policy.max_instances:
            return Decision(reason=f"at max {policy.max_instances}", mean_freeness=mean)
        count = 1
        if policy.max_launch > 1:  # back to the middle of [x, y]
            want = launch_count(latest, (policy.scale_out_below + policy.scale_in_above) / 2)
            count = max(1, min(want, policy.max_launch, policy.max_instances - n))
        return Decision(SCALE_OUT, reason=f"mean freeness {mean:.1f} < {policy.scale_out_below}",
                        mean_freeness=mean, count=count)
    if mean > policy.scale_in_above:
        if n <= policy.min_instances:
            return Decision(reason=f"at min {policy.min_instances}", mean_freeness=mean)
        cands = [i for i in live if stoppable is None or i.instance_id in stoppable]
        if not cands:
            return Decision(reason="no stoppable instance", mean_freeness=mean)
        # Fewest running requests (queued and just-dispatched ones count too);
        # ties: the newest id (highest), deterministic.
        victim = min(cands, key=lambda i: (i.num_running + i.num_waiting + i.pending_requests,
                                           _neg_key(i.instance_id)))
        return Decision(SCALE_IN, victim.instance_id,
                        f"mean freeness {mean:.1f} > {policy.scale_in_above}", mean)
    return Decision(reason="within range", mean_freeness=mean)


def snapshot(now: float, views) -> Snapshot:
    """A sample of the cluster view (scheduler InstanceViews) for ``decide``."""
    return Snapshot(now, tuple(
        InstanceSample(v.instance_id, v.status.normal_freeness, v.status.num_running,
                       v.status.num_waiting, v.status.terminating, v.pending_requests, v.status.total_blocks,
                       sum(1 for r in v.status.requests if r.priority == Priority.NORMAL and r.state != RequestPhase.WAITING))
        for v in views))


def add_sample(window: deque[Snapshot], snap: Snapshot, policy: AutoscalePolicy) -> None:
    """Append a sample and forget those older than 1.5 windows."""
    window.append(snap)
    horizon = snap.t - policy.window_s * 1.5
    while window and window[0].t < horizon:
        window.popleft()


def _neg_key(s: str) -> tuple:
    """Sort key that orders strings descending (natural order on digit runs)."""
    import re

    parts = [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]
    return tuple((-p if isinstance(p, int) else tuple(-ord(c) for c in p)) for p in parts)


@dataclass
class ScaleEvent:
    t: float
    action: str
    instance_id: str | None
    reason: str
    done_at: float | None = None


@dataclass
class _Drain:
    instance_id: str
    since: float
    marked: bool = False


DRAIN_TIMEOUT_S = 120.0  # a drain that takes longer is given up: the instance serves again
STARTUP_GRACE_S = 3.0  # no decision this soon after a (re)start: instances are still registering
REGISTER_TIMEOUT_S = 30.0  # a launched instance not in the view counts as launching this long


class Autoscaler:
    """The scheduler's scaling loop: sample the view, decide, act."""

    def __init__(self, view, launcher, policy: AutoscalePolicy, interval_s: float = 0.5,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S, startup_grace_s: float = STARTUP_GRACE_S,
                 state: LeaderState | None = None,
                 register_timeout_s: float = REGISTER_TIMEOUT_S, clients: InstanceClients | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
        """``view``: the cluster view (libs/common/cluster_view.py);
        ``launcher``: what starts and stops instances (launcher.py,
        k8s_launcher.py; the simulator's); ``state``: what a next leader
        takes over; ``clients``: how it reaches an instance
        (libs/common/instance_client.py: gRPC, or the simulator's);
        ``clock``/``wall_clock``: its monotonic and wall time (the
        simulator's virtual clock for both)."""
        self.view = view
        self.clients = clients or GrpcInstanceClients()
        self.clock = clock
        self.wall_clock = wall_clock
        # Drains under way and the last action's time outlive this leader
        # (services/scheduler/state.py): the next one finishes the drains.
        self.state = state or MemoryState()
        # Instances register in the first seconds after a (re)start of the
        # scheduler: an empty early view must not look like "below min".
        self.startup_grace_s = startup_grace_s
        self._started_at = 0.0
        self.launcher = launcher
        self.policy = policy
        self.interval_s = interval_s
        self.drain_timeout_s = drain_timeout_s
        # An instance the launcher runs counts as being launched until the
        # view lists it: a local launch returns when its health check serves,
        # before it has registered; an adopted one (a new leader) may not have
        # registered yet either. Else a tick in between sees one fewer than
        # min and launches again. Bounded, for one that never registers.
        self.register_timeout_s = register_timeout_s
        self._unlisted_since: dict[str, float | None] = {}  # None: timed out
        self.window: deque[Snapshot] = deque()
        self.last_action_at: float | None = None
        self.launching: set[asyncio.Task] = set()
        self.draining: dict[str, _Drain] = {}
        self.events: list[ScaleEvent] = []
        self._task: asyncio.Task | None = None
        # A launched instance that dies on its own is replaced: at once, then
        # with a doubling back-off while replacements keep dying.
        self.replacing = RestartBackoff()

    def start(self) -> None:
        self._started_at = self.clock()
        self._task = asyncio.create_task(self._loop())

    async def adopt(self) -> None:
        """Take over a previous leader's drains and cooldown."""
        wall, mono = self.wall_clock(), self.clock()
        for iid, rec in (await self.state.load("draining")).items():
            self.draining.setdefault(iid, _Drain(iid, mono - max(0.0, wall - rec.get("since", wall)), marked=True))
        last = (await self.state.load("autoscaler")).get("last_action")
        if last and "t" in last:
            self.last_action_at = mono - max(0.0, wall - last["t"])
        if self.draining:
            log.info("autoscaler: drains taken over", instances=sorted(self.draining))

    async def _acted(self) -> None:
        self.last_action_at = self.clock()
        await self.state.put("autoscaler", "last_action", {"t": self.wall_clock()})

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self.launching] if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- the loop ---------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.view.synced.is_set():
                continue
            if self.clock() - self._started_at < self.startup_grace_s:
                continue
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the loop must go on
                log.error("autoscaler tick failed", error=repr(e))

    def sample(self, now: float) -> Snapshot:
        return snapshot(now, self.view.views())

    async def tick(self) -> Decision:
        now = self.clock()
        sync = getattr(self.launcher, "sync", None)
        if sync:
            await sync()
        reap = getattr(self.launcher, "reap", None)
        if reap:
            for iid in reap():
                if self.draining.pop(iid, None) is not None:
                    log.warning("launched instance died while draining", instance_id=iid)
                    await self.state.delete("draining", iid)
                    continue
                delay = self.replacing.died(now)
                log.warning("launched instance died; replacing it", instance_id=iid, delay_s=delay)
                self._launch(now, Decision(SCALE_OUT, reason=f"replaces {iid}, which died"), delay_s=delay)
        await self._check_drains(now)
        add_sample(self.window, self.sample(now), self.policy)
        d = decide(list(self.window), self.policy, now=now, last_action_at=self.last_action_at,
                   launching=len(self.launching) + self._unlisted(now), draining=len(self.draining),
                   stoppable=frozenset(self.launcher.stoppable()))
        if d.action == SCALE_OUT:
            self._scale_out(now, d)
        elif d.action == SCALE_IN and d.instance_id:
            await self._scale_in(now, d)
        return d

    def _scale_out(self, now: float, d: Decision) -> None:
        self.last_action_at = now
        log.info("scale out", reason=d.reason, count=d.count, live=len(self.window[-1].live()) if self.window else 0)
        for _ in range(d.count):
            self._launch(now, d)

    def _launch(self, now: float, d: Decision, delay_s: float = 0.0) -> None:
        ev = ScaleEvent(now, SCALE_OUT, None, d.reason)
        self.events.append(ev)

        async def run():
            try:
                if delay_s:
                    await asyncio.sleep(delay_s)
                self.replacing.started(self.clock())
                ev.instance_id = await self.launcher.launch()
                ev.done_at = self.clock()
            except Exception as e:  # noqa: BLE001
                log.error("launch failed", error=repr(e))
            finally:
                # The cooldown counts from when the newcomer is up.
                await self._acted()

        t = asyncio.create_task(run())
        self.launching.add(t)
        t.add_done_callback(self.launching.discard)

    def _unlisted(self, now: float) -> int:
        """Instances the launcher runs that the view does not list yet
        (for at most ``register_timeout_s`` each)."""
        listed = {v.instance_id for v in self.view.views()}
        running = set(self.launcher.instances())
        for iid in [i for i in self._unlisted_since if i in listed or i not in running]:
            del self._unlisted_since[iid]
        n = 0
        for iid in running - listed:
            since = self._unlisted_since.setdefault(iid, now)
            if since is None:
                continue  # timed out already
            if now - since < self.register_timeout_s:
                n += 1
            else:
                self._unlisted_since[iid] = None
                log.warning("launched instance not in the view; no longer counted as launching",
                            instance_id=iid, timeout_s=self.register_timeout_s)
        return n

    async def _scale_in(self, now: float, d: Decision) -> None:
        self.last_action_at = now
        self.events.append(ScaleEvent(now, SCALE_IN, d.instance_id, d.reason))
        log.info("scale in: draining", instance_id=d.instance_id, reason=d.reason)
        dr = _Drain(d.instance_id, now)
        self.draining[d.instance_id] = dr
        await self.state.put("draining", d.instance_id, {"since": self.wall_clock()})
        dr.marked = await self._set_terminating(d.instance_id, True)

    async def _set_terminating(self, instance_id: str, value: bool) -> bool:
        address = self.view.address(instance_id)
        if address is None:
            return False
        try:
            await self.clients(instance_id, address).set_terminating(value)
            return True
        except FerryError as e:
            log.warning("set terminating failed", instance_id=instance_id, error=e.code.name)
            return False

    async def _check_drains(self, now: float) -> None:
        views = {v.instance_id: v for v in self.view.views()}
        for iid, dr in list(self.draining.items()):
            v = views.get(iid)
            if iid not in self.launcher.instances():
                self.draining.pop(iid, None)  # died or stopped meanwhile
                await self.state.delete("draining", iid)
                continue
            if v is None:
                if now - dr.since > self.drain_timeout_s:
                    await self._finish_drain(iid)
                continue
            if not v.status.terminating:
                dr.marked = await self._set_terminating(iid, True)  # e.g. the mark was lost
                continue
            s = v.status
            empty = (s.num_running == 0 and s.num_waiting == 0 and s.migrating_out == 0
                     and s.migrating_in == 0 and v.pending_requests == 0)
            if empty and await self._empty_now(iid):
                await self._finish_drain(iid)
            elif now - dr.since > self.drain_timeout_s:
                # Stopping it now would cut streams over to recompute: give up
                # the scale-in instead and let it serve again.
                log.warning("drain timed out; keeping the instance", instance_id=iid)
                await self._set_terminating(iid, False)
                self.draining.pop(iid, None)
                await self.state.delete("draining", iid)

    async def _empty_now(self, instance_id: str) -> bool:
        """Ask the instance itself (the view may lag a report)."""
        address = self.view.address(instance_id)
        if address is None:
            return False
        try:
            s = await self.clients(instance_id, address).status()
        except FerryError:
            return False
        return s.num_running == 0 and s.num_waiting == 0 and s.migrating_out == 0 and s.migrating_in == 0

    async def _finish_drain(self, instance_id: str) -> None:
        self.draining.pop(instance_id, None)
        await self.launcher.stop(instance_id)
        self.clients.forget(instance_id)
        await self.state.delete("draining", instance_id)
        for ev in reversed(self.events):
            if ev.action == SCALE_IN and ev.instance_id == instance_id and ev.done_at is None:
                ev.done_at = self.clock()
                break
        await self._acted()
        log.info("scale in: stopped", instance_id=instance_id)
