"""Auto-scaling on the virtual clock: the loop of services/scheduler/
autoscaler.py (Autoscaler.tick) around the same pure ``decide``, with a
launcher that starts a simulated instance after Delays.launch_s and stops a
drained one at once.

As live: the instances of the initial fleet are not the launcher's and are
never stopped; a scale-in marks the instance terminating (its fake request
of infinite virtual usage makes it a migration source), and it is stopped
once it is empty or given back after the drain timeout. Cost: an instance
counts from its launch (its GPU is taken while it loads) until it stops.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from services.scheduler.autoscaler import (
    SCALE_IN,
    SCALE_OUT,
    AutoscalePolicy,
    Snapshot,
    add_sample,
    decide,
    snapshot,
)
from services.scheduler.service import SchedulerConfig

if TYPE_CHECKING:
    from ferry.sim.run import Cluster

DRAIN_TIMEOUT_S = 120.0  # Autoscaler's drain_timeout_s
STARTUP_GRACE_S = 3.0  # Autoscaler's startup_grace_s


class SimAutoscaler:
    def __init__(self, cluster: Cluster, config: SchedulerConfig, wall: float):
        c = config
        self.cluster = cluster
        self.k = cluster.k
        self.wall = wall
        # Windows, cooldowns and intervals are wall time on a live cluster.
        self.policy = AutoscalePolicy(c.scale_out_below, c.scale_in_above, c.scale_window_s * wall, c.min_instances,
                                      c.max_instances, c.scale_cooldown_s * wall, max_launch=c.scale_out_max_launch)
        self.interval_s = c.autoscale_interval_s * wall
        self.window: deque[Snapshot] = deque()
        self.last_action_at: float | None = None
        self.launching = 0
        self.launched: set[str] = set()  # the launcher's instances (stoppable)
        self.draining: dict[str, float] = {}  # instance -> drain start
        self.events: list[dict] = []
        self._started_at = 0.0

    def start(self) -> None:
        self._started_at = self.k.now
        self.k.after(self.interval_s, self._tick)

    def _tick(self) -> None:
        self.k.after(self.interval_s, self._tick)
        now = self.k.now
        if now - self._started_at < STARTUP_GRACE_S * self.wall:
            return
        self._check_drains(now)
        sched = self.cluster.scheduler
        add_sample(self.window, snapshot(now, sched.views()), self.policy)
        d = decide(list(self.window), self.policy, now=now, last_action_at=self.last_action_at,
                   launching=self.launching, draining=len(self.draining), stoppable=frozenset(self.launched))
        if d.action == SCALE_OUT:
            self.last_action_at = now
            self.launching += d.count
            self.events.append({"t": now - self.cluster.t0, "action": SCALE_OUT, "reason": d.reason,
                                "count": d.count})
            self.cluster._log_instances()
            for _ in range(d.count):
                self.k.after(self.cluster.delays.launch_s, self._launched)
        elif d.action == SCALE_IN and d.instance_id:
            self.last_action_at = now
            self.events.append({"t": now - self.cluster.t0, "action": SCALE_IN, "instance": d.instance_id,
                                "reason": d.reason})
            self.draining[d.instance_id] = now
            self._set_terminating(d.instance_id, True)

    def _launched(self) -> None:
        self.launching -= 1
        inst = self.cluster.add_instance()
        self.launched.add(inst.instance_id)
        self.last_action_at = self.k.now  # the cooldown counts from when the newcomer is up

    def _set_terminating(self, iid: str, value: bool) -> None:
        self.k.after(self.cluster.delays.rpc_s / 2, self.cluster.instances[iid].set_terminating, value)

    def _check_drains(self, now: float) -> None:
        views = {v.instance_id: v for v in self.cluster.scheduler.views()}
        for iid, since in list(self.draining.items()):
            v = views.get(iid)
            inst = self.cluster.instances[iid]
            if v is None or not v.status.terminating:
                if v is not None:
                    self._set_terminating(iid, True)
                continue
            s = v.status
            empty = (s.num_running == 0 and s.num_waiting == 0 and s.migrating_out == 0 and s.migrating_in == 0
                     and v.pending_requests == 0)
            if empty and not inst.engine.has_work() and not inst.migrations_under_way():
                del self.draining[iid]
                self.launched.discard(iid)
                self.cluster.stop_instance(iid)
                self.last_action_at = now
            elif now - since > DRAIN_TIMEOUT_S * self.wall:
                self._set_terminating(iid, False)
                del self.draining[iid]
