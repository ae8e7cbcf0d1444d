"""The cluster's prefix index, fed live: one ``WatchKvEvents`` stream per
instance of a cluster view (a snapshot, then each step's batch), applied to
the pure index (libs/common/prefix_index.py). The scheduler keeps one for
its prefix-aware policies; a frontend keeps one while the scheduler's policy
is prefix-aware, for its bypass dispatch (services/frontend/router.py).

Never stale: an instance whose stream breaks, or whose batches skip a
number, is dropped from the index until a new snapshot comes; an instance
that leaves the view is dropped. A restarted scheduler rebuilds everything
from snapshots; a meta store restart does not touch the streams (the view
keeps its instances meanwhile, docs/design.md §7).
"""

from __future__ import annotations

import asyncio

import grpc

from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.common import convert, rpc
from libs.common.cluster_view import ClusterView
from libs.common.logging import get_logger
from libs.common.prefix_index import PrefixIndex
from libs.common.backoff import Reconnect

log = get_logger(__name__)


class Resync(Exception):
    """A batch did not follow the last one applied: start from a snapshot."""


class KvIndexWatcher:
    def __init__(self, view: ClusterView, index: PrefixIndex | None = None, reconcile_s: float = 0.2,
                 max_backoff_s: float = 2.0):
        self.view = view
        self.index = index or PrefixIndex()
        self.reconcile_s = reconcile_s
        self.max_backoff_s = max_backoff_s
        self._streams: dict[str, tuple[str, asyncio.Task]] = {}  # instance -> (address, its task)
        self.synced: set[str] = set()  # instances whose snapshot was applied and whose stream is live
        self.resyncs = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._reconcile_forever())

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *(t for _, t in self._streams.values())] if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._streams.clear()

    async def _reconcile_forever(self) -> None:
        while True:
            try:
                self.reconcile()
            except Exception as e:  # noqa: BLE001 - the loop must go on
                log.error("prefix index reconcile failed", error=repr(e))
            await asyncio.sleep(self.reconcile_s)

    def reconcile(self) -> None:
        """Follow every instance of the view, and only those."""
        want = {iid: rec.info.address for iid, rec in self.view.records.items()}
        for iid in [i for i, (addr, _) in self._streams.items() if want.get(i) != addr]:
            _, task = self._streams.pop(iid)
            task.cancel()
            self._forget(iid)
        for iid, addr in want.items():
            if iid not in self._streams:
                self._streams[iid] = (addr, asyncio.create_task(self._follow(iid, addr)))

    def hits(self, block_hashes: list[int], block_size: int) -> dict[str, int]:
        """Per instance of the view, how many of the first ``block_hashes``
        (hashed at ``block_size`` tokens a block) its prefix cache holds
        (instances whose stream is not synced are not in the index;
        instances of another block size hold none of these hashes)."""
        if block_size <= 0 or not block_hashes:
            return {}
        recs = self.view.records
        return {iid: n for iid, n in self.index.match(block_hashes).items()
                if iid in recs and recs[iid].info.block_size == block_size}

    def _forget(self, iid: str) -> None:
        self.index.remove(iid)
        self.synced.discard(iid)

    async def _follow(self, iid: str, address: str) -> None:
        backoff = Reconnect(max_s=self.max_backoff_s)
        while True:
            try:
                async with rpc.channel(address) as ch:
                    call = ipb_grpc.InstanceStub(ch).WatchKvEvents(ipb.WatchKvEventsRequest())
                    async for m in call:
                        self._apply(iid, m)
                        backoff.reset()
                log.info("instance ended its KV event stream", instance_id=iid)
            except asyncio.CancelledError:
                self._forget(iid)
                raise
            except Resync:
                self.resyncs += 1
                log.warning("KV events skipped a batch; resyncing", instance_id=iid)
            except grpc.RpcError as e:
                if iid in self.synced:
                    log.warning("KV event stream lost", instance_id=iid, error=e.code().name)
            self._forget(iid)
            await backoff.wait()

    def _apply(self, iid: str, m) -> None:
        kind = m.WhichOneof("body")
        if kind == "snapshot":
            snap = convert.kv_snapshot_from_pb(m.snapshot)
            if snap.instance_id != iid:
                raise Resync(f"a snapshot of {snap.instance_id!r} on {iid!r}'s stream")
            self.index.reset(snap)
            self.synced.add(iid)
        elif kind == "batch":
            batch = convert.kv_batch_from_pb(m.batch)
            if batch.instance_id != iid or not self.index.apply(batch):
                raise Resync(f"batch {batch.seq} after {self.index.seq_of(iid)}")
