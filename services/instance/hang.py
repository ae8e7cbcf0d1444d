"""A hung engine is found: an engine step that runs far past the expected
step time (the longest of the recent steps, a long prompt's chunk included)
marks the instance unschedulable (its reports say so: nothing is placed or
migrated there) and NOT_SERVING; a step that then ends makes it schedulable
again. Past ``stop_s`` the instance stops: its streams end UNAVAILABLE (the
frontend resumes the requests elsewhere by recompute; a thread stuck inside
a step cannot hand anything over) and the process exits EXIT_ENGINE_HUNG
for whoever started it to start it again."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass

from libs.common.logging import get_logger

log = get_logger(__name__)


class Health(enum.Enum):
    STEPPING = "stepping"  # steps end in their expected time (or it is idle)
    HUNG = "hung"  # the step under way is far past it: unschedulable
    STOPPING = "stopping"  # past stop_s: the instance stops


@dataclass(frozen=True)
class HangLimits:
    factor: float = 2.0  # a step past factor x the expected step time is hung ...
    floor_s: float = 1.0  # ... and past this long in any case (the first steps, a noisy host)
    stop_s: float = 60.0  # a step hung this long stops the instance (0: never)

    def hung_after_s(self, expected_s: float | None) -> float:
        return max(self.floor_s, self.factor * (expected_s or 0.0))


def judge(running_s: float, expected_s: float | None, limits: HangLimits) -> Health:
    """Pure: the engine's health from how long its step has run."""
    if limits.stop_s and running_s >= max(limits.stop_s, limits.hung_after_s(expected_s)):
        return Health.STOPPING
    if running_s >= limits.hung_after_s(expected_s):
        return Health.HUNG
    return Health.STEPPING


class HangMonitor:
    def __init__(self, runner, limits: HangLimits, on_change: Callable[[Health, float], None],
                 interval_s: float | None = None):
        """``on_change(health, running_s)`` runs on the event loop at every change."""
        self.runner = runner
        self.limits = limits
        self.on_change = on_change
        self.interval_s = interval_s or max(0.01, min(0.1, limits.floor_s / 10))
        self.health = Health.STEPPING
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def check(self) -> Health:
        running = self.runner.step_running_s()
        health = judge(running, self.runner.expected_step_s(), self.limits)
        if health is not self.health:
            log.warning("engine health", health=health.value, step_running_s=round(running, 3),
                        expected_step_s=self.runner.expected_step_s(), previous=self.health.value)
            self.health = health
            self.on_change(health, running)
        return health

    async def _loop(self) -> None:
        while self.health is not Health.STOPPING:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the watcher must outlive a bad callback
                log.error("hang check failed", error=repr(e))
