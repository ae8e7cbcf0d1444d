"""A cluster view's liveness while the meta store cannot be reached (docs/design.md
§7 keeps the last view then): without it nothing would expire, and an
instance that died during the outage would stay a dispatch target.

While the view is cut off, ``poll_instances`` asks every instance in it for
its status itself (``Instance.GetStatus``), every ``interval_s``: an answer
refreshes the instance's status in the view; one that has not answered for
``ttl_s`` leaves the view (its pending dispatches with it). It stops when the
watch is back (the caller cancels it): the meta store's snapshot then wins.
Cost: one small call per instance per interval, during an outage only."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc

from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.common import convert, rpc
from libs.common.logging import get_logger

log = get_logger(__name__)


async def poll_instances(view, interval_s: float = 0.5, ttl_s: float = 3.0, timeout_s: float = 1.0) -> None:
    """``view``: a ClusterView (``records``, ``drop``). Runs until cancelled."""
    answered = {iid: time.monotonic() for iid in view.records}
    channels: dict[str, grpc.aio.Channel] = {}

    async def ask(iid: str, address: str) -> None:
        ch = channels.get(address)
        if ch is None:
            ch = channels[address] = rpc.channel(address)
        try:
            st = await ipb_grpc.InstanceStub(ch).GetStatus(ipb.GetStatusRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return
        rec = view.records.get(iid)
        if rec is not None and rec.info.address == address:
            answered[iid] = time.monotonic()
            view.records[iid] = replace(rec, status=convert.status_from_pb(st), last_seen=time.time())
            view.touch(iid)
            view.changed.set()

    try:
        while True:
            await asyncio.gather(*(ask(iid, rec.info.address) for iid, rec in list(view.records.items())))
            now = time.monotonic()
            for iid in list(view.records):
                if now - answered.setdefault(iid, now) > ttl_s:
                    log.warning("instance unreachable while the meta store is down; dropped from the view",
                                instance_id=iid)
                    view.drop(iid)
            await asyncio.sleep(interval_s)
    finally:
        for ch in channels.values():
            await ch.close()
