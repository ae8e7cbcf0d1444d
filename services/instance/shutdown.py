"""A graceful stop of an instance (SIGTERM: a rolling restart, a scale-in, a
node drain) hands its requests to other instances by live migration before
it exits, as the scale-in path does: the instance marks itself terminating
(its next report tells the scheduler: nothing new is placed here, and the
rescheduler drains it too), then migrates every request it holds to the
registered instances that can take one (most free first), again and again
until none is left or ``max_s`` passed. Requests that arrive meanwhile (placed
before the mark was seen) leave the same way once they run. What is left at
the end resumes elsewhere by recompute when the instance stops."""

from __future__ import annotations

import asyncio
import time

import grpc

from libs.pb import meta_store_pb2 as mpb
from libs.pb import meta_store_pb2_grpc as mpb_grpc
from libs.common import convert, rpc
from libs.common.logging import get_logger

log = get_logger(__name__)


async def drain_targets(meta_store: str, instance_id: str, timeout_s: float = 2.0) -> list[tuple[str, str]]:
    """(instance id, address) of the registered instances that can take a
    request now: reported, not terminating, not hung, decoding, migratable;
    the most free first."""
    async with rpc.channel(meta_store) as ch:
        reply = await mpb_grpc.MetaStoreStub(ch).List(mpb.ListRequest(), timeout=timeout_s)
    records = [convert.record_from_pb(r) for r in reply.instances]
    ok = [r for r in records if r.info.instance_id != instance_id and r.status is not None
          and not r.status.terminating and not r.status.unschedulable and r.status.role.decodes
          and not r.info.no_migration]
    ok.sort(key=lambda r: r.status.freeness, reverse=True)
    return [(r.info.instance_id, r.info.address) for r in ok]


async def drain_for_shutdown(manager, meta_store: str, instance_id: str, max_s: float,
                             held: callable, poll_s: float = 0.2, no_target_s: float = 5.0) -> int:
    """Migrate every request out (see the module doc). ``held()``: how many
    requests are still here. Gives up after ``no_target_s`` without any
    instance to take them (the whole cluster stops, or the meta store is
    gone). Returns how many were left."""
    deadline = time.monotonic() + max_s
    rounds = 0
    last_target = time.monotonic()
    while held() and time.monotonic() < deadline:
        try:
            targets = await drain_targets(meta_store, instance_id)
        except grpc.RpcError as e:
            log.warning("shutdown drain: meta store unreachable", error=e.code().name)
            targets = []
        if not targets and time.monotonic() - last_target > no_target_s:
            log.warning("shutdown drain: no instance takes requests; stopping with them", left=held())
            break
        if targets:
            last_target = time.monotonic()
            rounds += 1
            left_s = max(0.1, deadline - time.monotonic())
            await manager.drain(targets, max_s=min(left_s, 30.0))
        if held():
            await asyncio.sleep(poll_s)
    left = held()
    log.info("shutdown drain done", rounds=rounds, left=left)
    return left
