"""Where a request goes: ask the scheduler; when it is unreachable, dispatch
locally from the last view of the meta store (bypass), and go back to the
scheduler when it returns.

Bypass runs the scheduler's own policy, as its last reply named it (a name
this frontend does not know, or none heard yet: ``llumnix``). Where that
policy is prefix-aware, the frontend follows the instances' KV events
(libs/common/kv_index.py) from the reply that names it on, so that a bypass
dispatch counts the cached prefixes from its first request; a prefix-blind
policy stops the streams."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import grpc

from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from libs.common import rpc, tracing
from libs.common.cluster_view import ClusterView
from libs.common.errors import Code, FerryError, Unavailable, from_grpc, is_unavailable
from libs.common.kv_index import KvIndexWatcher
from libs.common.logging import get_logger
from libs.common.policies import POLICIES, Dispatcher, DispatchRequest, get
from libs.common.policies.phases import Placement, count_placed, place
from libs.common.prefix_hash import block_hashes
from libs.common.types import Priority
from services.frontend import metrics
from services.frontend.dispatch_stream import DispatchStream, StreamBroken
from services.frontend.peers import GrpcPeers, InstancePeers
from services.frontend.watchdog import StallWatchdog

log = get_logger(__name__)


class Dispatched(NamedTuple):
    """Where a request goes, and (Splitwise) where it decodes: an instance
    that receives its KV once the prompt is done ("" = it stays)."""

    instance_id: str
    address: str
    run_priority: Priority
    decode_instance_id: str = ""
    decode_address: str = ""


class Router:
    def __init__(self, scheduler: str, meta_store: str, dispatch_timeout_s: float = 1.0,
                 bypass_retry_s: float = 1.0, status_interval_s: float = 0.0, stall_timeout_s: float = 60.0,
                 dispatch_stream: bool = True, prefix_index: bool = True):
        self.scheduler_address = scheduler
        self.dispatch_timeout_s = dispatch_timeout_s
        self.bypass_retry_s = bypass_retry_s
        self.view = ClusterView(meta_store, min_update_interval_s=status_interval_s)
        # Bypass dispatch runs the scheduler's policy as its replies name it
        # (llumnix until one does); round robin covers a view without statuses.
        self._local = Dispatcher(get("llumnix"))
        self.prefix_index = prefix_index  # follow KV events while the scheduler's policy is prefix-aware
        self.kv_index: KvIndexWatcher | None = None
        self._rr = Dispatcher(get("round_robin"))
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, ipb_grpc.InstanceStub] = {}
        self._sched = spb_grpc.SchedulerStub(self.channel(scheduler))
        self._stream = DispatchStream(self._sched, enabled=dispatch_stream)
        self.bypass = False
        self._bypass_until = 0.0
        # Hash the prompt for Dispatch until the scheduler's replies name a
        # prefix-blind policy (hashing a 2,048-token prompt costs ~0.3 ms
        # here); a policy this frontend does not know gets the hashes.
        self._send_hashes = True
        self.watchdog = StallWatchdog(self.instance, stall_timeout_s)
        self.peers: InstancePeers = GrpcPeers(self.instance)  # how generation.py reaches instances

    def start(self) -> None:
        self.view.start()
        self.watchdog.start()

    async def close(self) -> None:
        await self._follow_prefixes(False)
        await self._stream.close()
        await self.watchdog.stop()
        await self.view.stop()
        for ch in self._channels.values():
            await ch.close()

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = rpc.channel(address)
            self._channels[address] = ch
        return ch

    def instance(self, address: str) -> ipb_grpc.InstanceStub:
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = ipb_grpc.InstanceStub(self.channel(address))
        return stub

    def max_model_len(self, default: int) -> int:
        lens = [r.info.max_model_len for r in self.view.records.values() if r.info.max_model_len > 0]
        return min(lens) if lens else default

    def serving_instances(self) -> int:
        """Instances a request can be placed on now: registered, reported, not draining."""
        return sum(1 for r in self.view.records.values() if r.status is not None and not r.status.terminating)

    async def is_registered(self, instance_id: str, address: str, wait_s: float = 2.0) -> bool:
        """Whether the meta store knows ``instance_id`` at ``address``,
        waiting up to ``wait_s`` for a view that may lag a registration."""
        deadline = time.monotonic() + wait_s
        while True:
            rec = self.view.records.get(instance_id)
            if rec is not None:
                return rec.info.address == address
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.view.changed.clear()
            try:
                async with asyncio.timeout(left):
                    await self.view.changed.wait()
            except TimeoutError:
                return False

    def vocab_size(self, default: int) -> int:
        """The vocabulary every instance accepts (``default`` when none says)."""
        sizes = [r.info.vocab_size for r in self.view.records.values() if r.info.vocab_size > 0]
        return min(sizes) if sizes else default

    def block_size(self) -> int:
        """The cluster's KV block size: the one most instances report (0: none known)."""
        sizes = Counter(r.info.block_size for r in self.view.records.values() if r.info.block_size > 0)
        return min(sizes, key=lambda b: (-sizes[b], b)) if sizes else 0

    async def dispatch(self, request_id: str, num_prompt_tokens: int, priority: Priority,
                       exclude: frozenset[str] = frozenset(), token_ids: Sequence[int] | None = None,
                       affinity: str = "", program_id: str = "") -> Dispatched:
        """Where a new request goes and the priority to run it at. The
        scheduler's policy decides the last; in bypass mode the request keeps
        its own. ``token_ids`` (the tokens the instance will be sent): their
        full blocks' hashes go with the request, for prefix-aware policies.
        ``affinity``: the instance to prefer if it can take it (DispatchRequest);
        ``program_id``: the program it is a turn of (DispatchRequest).
        With tracing on, a span of its own (the scheduler's is its sibling)."""
        if not tracing.enabled():
            return await self._dispatch(request_id, num_prompt_tokens, priority, exclude, token_ids, affinity,
                                        program_id)
        t0 = time.time_ns()
        d = await self._dispatch(request_id, num_prompt_tokens, priority, exclude, token_ids, affinity, program_id)
        # A span of the past, made once the response is out (services/frontend/tracing.py).
        tracing.record("ferry.dispatch", t0, time.time_ns(), {
            "ferry.request_id": request_id, "ferry.priority": priority.name, "ferry.excluded": sorted(exclude),
            "ferry.instance_id": d.instance_id, "ferry.decode_instance_id": d.decode_instance_id,
            "ferry.bypass": self.bypass})
        tracing.annotate(**{"ferry.request_id": request_id, "ferry.prompt_tokens": num_prompt_tokens})
        return d

    async def _dispatch(self, request_id: str, num_prompt_tokens: int, priority: Priority,
                        exclude: frozenset[str], token_ids: Sequence[int] | None, affinity: str = "",
                        program_id: str = "") -> Dispatched:
        if time.monotonic() >= self._bypass_until:
            req = spb.DispatchRequest(request_id=request_id, num_prompt_tokens=num_prompt_tokens,
                                      priority=int(priority), exclude_instance_ids=sorted(exclude),
                                      affinity_instance_id=affinity, traceparent=tracing.traceparent(),
                                      program_id=program_id)
            bs = self.block_size() if token_ids and self._send_hashes else 0
            if bs:
                req.block_size = bs
                req.block_hashes.extend(block_hashes(token_ids, bs))
            reply, down = await self._ask_scheduler(req)
            if reply is not None:
                self._send_hashes = self._policy_uses_prefix(reply.policy)
                await self._adopt(reply.policy)
                if self.bypass:
                    log.info("scheduler is back; leaving bypass mode")
                    self.bypass = False
                    metrics.BYPASS.set(0)
                return Dispatched(reply.instance_id, reply.address, Priority(reply.run_priority),
                                  reply.decode_instance_id, reply.decode_address)
            if not self.bypass:
                log.warning("scheduler unreachable; dispatching by myself (bypass mode)", error=down)
            self.bypass = True
            metrics.BYPASS.set(1)
            self._bypass_until = time.monotonic() + self.bypass_retry_s
        return self._dispatch_locally(request_id, num_prompt_tokens, priority, exclude, token_ids, affinity,
                                      program_id)

    @staticmethod
    def _policy_uses_prefix(name: str) -> bool:
        p = POLICIES.get(name)
        return p is None or p.uses_prefix

    async def _adopt(self, name: str) -> None:
        """The scheduler's policy, for bypass: the same policy here (a name
        unknown here keeps the last one), and the prefix index while it is
        prefix-aware."""
        if name in POLICIES and name != self._local.name:
            self._local = Dispatcher(get(name))
            log.info("bypass dispatch follows the scheduler's policy", policy=name)
        await self._follow_prefixes(self.prefix_index and self._local.policy.uses_prefix)

    async def _follow_prefixes(self, on: bool) -> None:
        if on and self.kv_index is None:
            self.kv_index = KvIndexWatcher(self.view)
            self.kv_index.start()
        elif not on and self.kv_index is not None:
            kv, self.kv_index = self.kv_index, None
            await kv.stop()

    def prefix_synced(self) -> int:
        """Instances whose cached prefixes bypass dispatch knows now."""
        return 0 if self.kv_index is None else len(self.kv_index.synced)

    async def _ask_scheduler(self, req: spb.DispatchRequest) -> tuple[spb.DispatchReply | None, str]:
        """The scheduler's reply, or (None, why) when it is unavailable (the
        bypass rule); any other failure raises its FerryError. Over the
        shared dispatch stream where the scheduler has it, else unary.

        NOTE: a stream that broke with another status than unavailable is
        not this request's error either: a scheduler killed mid-stream ends
        it with INTERNAL ("Internal error from Core") as often as with
        UNAVAILABLE, and every request waiting on it got a 500 (the
        Prometheus live test's bypass requests, 2026-12). The request is
        asked again with a unary call, whose failure is classified alone."""
        if self._stream.supported and not self._stream.busy(req.request_id):
            try:
                reply = await self._stream.ask(req, self.dispatch_timeout_s)
            except StreamBroken as e:
                if self._stream.supported:
                    if e.unavailable:
                        return None, str(e)
                    log.info("dispatch stream broke; asking with a unary call", request_id=req.request_id,
                             error=str(e.error))
            else:
                if not reply.error_code:
                    return reply, ""
                try:
                    code = Code(reply.error_code)
                except ValueError:  # a code this frontend does not know
                    code = Code.INTERNAL
                err = FerryError(reply.error_message, code=code)
                if is_unavailable(err):
                    return None, err.code.name
                raise err
        try:
            return await self._sched.Dispatch(req, timeout=self.dispatch_timeout_s), ""
        except grpc.RpcError as e:
            if not is_unavailable(e):
                raise from_grpc(e) from e
            return None, e.code().name

    def _dispatch_locally(self, request_id, num_prompt_tokens, priority, exclude, token_ids=None,
                          affinity: str = "", program_id: str = "") -> Dispatched:
        metrics.BYPASS_DISPATCHES.inc()
        req = DispatchRequest(request_id, num_prompt_tokens, priority, exclude, affinity=affinity,
                              program_id=program_id)
        bs = self.block_size() if token_ids and self.kv_index is not None and self._local.policy.uses_prefix else 0
        if bs:
            hashes = block_hashes(token_ids, bs)
            req = DispatchRequest(request_id, num_prompt_tokens, priority, exclude, prefix_blocks=len(hashes),
                                  hits=self.kv_index.hits(hashes, bs), affinity=affinity, program_id=program_id)
        views = self.view.views()
        placed = place(self._local, views, req) if views else None
        if placed is None:  # no status known yet: round robin over registered instances
            ids = sorted(i for i in self.view.records if i not in exclude)
            if not ids:
                raise Unavailable("no instance available (scheduler unreachable, none known)")
            placed = Placement(ids[self._rr.next_round_robin(len(ids))])
        records = self.view.records
        count_placed(placed, req, lambda iid: records[iid].info.block_size, bs, self.view.add_pending)
        rec = records[placed.prefill]
        if placed.decode is None:
            return Dispatched(placed.prefill, rec.info.address, priority)
        return Dispatched(placed.prefill, rec.info.address, priority, placed.decode,
                          records[placed.decode].info.address)
