"""``ferry up`` starts the cluster's processes, so it starts them again when
they die (an instance whose engine died exits 3, a hung one 4; any process
killed): at once the first time, then with a doubling back-off
(libs/common/backoff.py). Requests of a dead instance resume elsewhere
meanwhile; the restarted one registers again and takes new ones."""

from __future__ import annotations

import time
from collections.abc import Callable

from ferry.cluster import LocalCluster
from libs.common.backoff import RestartBackoff


class Supervisor:
    def __init__(self, cluster: LocalCluster, say: Callable[[str], None] = print, base_s: float = 1.0,
                 max_s: float = 30.0, stable_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.cluster = cluster
        self.say = say
        self.clock = clock
        now = clock()
        self.backoff = {c.name: RestartBackoff(base_s, max_s, stable_s, started_at=now) for c in cluster.children}
        self.restarts = 0

    def tick(self) -> list[str]:
        """Notice deaths and restart what is due; returns the names restarted."""
        now = self.clock()
        restarted = []
        for c in self.cluster.children:
            b = self.backoff.setdefault(c.name, RestartBackoff(started_at=now))
            if c.alive():
                continue
            if b.due_at is None:
                delay = b.died(now)
                self.say(f"{c.name} exited with code {c.proc.returncode if c.proc else None}; "
                         f"restarting {'now' if delay == 0 else f'in {delay:g}s'}")
            if b.due(now):
                self.cluster.respawn(c.name)
                b.started(now)
                self.restarts += 1
                restarted.append(c.name)
        return restarted
