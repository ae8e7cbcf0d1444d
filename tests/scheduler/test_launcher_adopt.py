"""A new leader's LocalProcessLauncher adopts the instances the previous
leader recorded (services/scheduler/launcher.py): by pid, only where the pid
still runs that instance, and stops them like its own."""

from __future__ import annotations

import subprocess
import sys

from services.scheduler.launcher import LocalProcessLauncher
from services.scheduler.state import MemoryState


def _fake_instance(iid: str) -> subprocess.Popen:
    # A process whose command line names the instance, as a launched one's does.
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--instance-id", iid])


async def test_adopts_live_recorded_instances_and_stops_them():
    state = MemoryState()
    alive = _fake_instance("auto-x-1")
    other = _fake_instance("someone-else")
    try:
        await state.put("launched", "auto-x-1", {"address": "127.0.0.1:1", "pid": alive.pid})
        await state.put("launched", "auto-x-2", {"address": "127.0.0.1:2", "pid": other.pid})  # pid reused
        await state.put("launched", "auto-x-3", {"address": "127.0.0.1:3", "pid": 2 ** 22 + 7})  # gone
        launcher = LocalProcessLauncher("127.0.0.1:0", "", state=state, survive_scheduler=True, stop_timeout_s=5)
        await launcher.adopt()
        assert launcher.instances() == ["auto-x-1"]
        assert set(await state.load("launched")) == {"auto-x-1"}  # the others forgotten
        await launcher.close()  # surviving the scheduler: released, not stopped
        assert alive.poll() is None and launcher.instances() == []
        await launcher.adopt()
        await launcher.stop("auto-x-1")
        assert alive.wait(5) is not None
        assert await state.load("launched") == {}
        assert other.poll() is None
    finally:
        for p in (alive, other):
            if p.poll() is None:
                p.kill()
                p.wait(5)


def test_survivors_are_not_tied_to_the_scheduler(monkeypatch):
    """With survive_scheduler the command has no parent-death signal: the owner
    bootstrap, with the cluster owner's pid (0: none)."""
    from libs.common.procs import _BOOTSTRAP, _BOOTSTRAP_OWNED, OWNER_PID_ENV

    monkeypatch.delenv(OWNER_PID_ENV, raising=False)
    sole = LocalProcessLauncher("127.0.0.1:0", "--engine fake").command("i", 1)
    kept = LocalProcessLauncher("127.0.0.1:0", "--engine fake", survive_scheduler=True).command("i", 1)
    assert sole[2] == _BOOTSTRAP and kept[2] == _BOOTSTRAP_OWNED and kept[3] == "0"
    monkeypatch.setenv(OWNER_PID_ENV, "4242")
    owned = LocalProcessLauncher("127.0.0.1:0", "--engine fake", survive_scheduler=True).command("i", 1)
    assert owned[3] == "4242"
