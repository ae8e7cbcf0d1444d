"""A role change at run time (Splitwise's mixed pool): an instance that
becomes ``prefill`` no longer decodes, so the requests decoding on it move to
instances that do, by live migration (pre-copy, no recompute, the client's
stream follows). Requests planned for a handoff leave by their handoff.

NOTE: never drops a request. One that no target takes (full, gone, refused)
stays and decodes here; the drain is one pass over what runs now plus what
the waiting queue admits while it runs, bounded in time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from libs.common.errors import ResourceExhausted
from libs.common.logging import get_logger
from libs.common.types import Outcome, RequestPhase
from services.instance.migration.host import MigrationHost

log = get_logger("migration")


@dataclass
class DrainResult:
    moved: list[str] = field(default_factory=list)
    stayed: list[str] = field(default_factory=list)  # no target took it: it decodes here


Leaving = Callable[[str], bool]  # a request already leaving (a migration or a planned handoff)
MigrateOne = Callable[[str, str, str], Awaitable[Outcome]]  # (request, destination id, address) -> its outcome


def decoding_here(host: MigrationHost, leaving: Leaving) -> tuple[list[str], int]:
    """(requests running here that would decode here: not ``leaving``;
    how many more wait to be admitted)."""
    mine = [r for r in host.current_load().requests if not leaving(r.request_id)]
    return [r.request_id for r in mine if r.state == RequestPhase.RUNNING], sum(1 for r in mine if r.state == RequestPhase.WAITING)


async def drain(host: MigrationHost, migrate_one: MigrateOne, leaving: Leaving, targets: list[tuple[str, str]],
                still: Callable[[], bool] = lambda: True, max_s: float = 60.0, poll_s: float = 0.02) -> DrainResult:
    """Move every request decoding here to ``targets`` ((instance id,
    address), in the order to try) with ``migrate_one``, a few at once (it
    raises ResourceExhausted at the instance's migrate-out limits); each
    request tries the targets in turn from a rotating start. Waiting requests
    go once they run. Stops when nothing is left to move, when ``still()``
    turns false (the role changed again) or after ``max_s``."""
    result = DrainResult()
    if not targets:
        return result
    tried: set[str] = set()
    running: set[asyncio.Task] = set()
    deadline = time.monotonic() + max_s
    turn = 0
    while still() and time.monotonic() < deadline:
        ready, waiting = decoding_here(host, leaving)
        todo = [r for r in ready if r not in tried]
        if not todo and not running and not waiting:
            break
        for rid in todo:
            tried.add(rid)
            running.add(asyncio.create_task(_move(host, migrate_one, leaving, rid, targets[turn:] + targets[:turn],
                                                  result)))
            turn = (turn + 1) % len(targets)
        await asyncio.sleep(poll_s)
        running = {t for t in running if not t.done()}
    if running:
        await asyncio.gather(*running, return_exceptions=True)
    log.info("drain done", moved=len(result.moved), stayed=len(result.stayed))
    return result


async def _move(host: MigrationHost, migrate_one: MigrateOne, leaving: Leaving, request_id: str,
                targets: list[tuple[str, str]], result: DrainResult) -> None:
    for dest_id, address in targets:
        while True:
            if leaving(request_id):
                return  # leaving already (a migrate-out order took it)
            try:
                out = await migrate_one(request_id, dest_id, address)
                break
            except ResourceExhausted:  # the migrate-out limit: wait for a slot
                await asyncio.sleep(0.01)
        if out.committed:
            result.moved.append(request_id)
            return
        if await host.runner.call(host.engine.request_phase, request_id) is None:
            return  # finished or aborted meanwhile: nothing to move
    result.stayed.append(request_id)
